"""MoonViT-style vision tower, projector and image-token assembly (``docs/vision.md``)."""
