"""Vision tower math against independent references: patch grids for odd sizes and the limit,
the position-grid interpolation (NumPy loops, PIL's bilinear resize, identity), 2-D RoPE (complex
multiplication per pair), merge order (vLLM-style permutation of a raster grid), packed images
(several images in one row == each alone), feature placement."""

import base64
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from kdsa.model.config import get_preset
from kdsa.model.vision import attention as vision_attention_module
from kdsa.model.vision.attention import vision_attention_blocked, vision_attention_dense
from kdsa.model.vision.assemble import pack_images, scatter_features
from kdsa.model.vision.inputs import decode_image, image_from_url
from kdsa.model.vision.patching import merge_order, patch_grid, patchify
from kdsa.model.vision.position import apply_rope_2d, interpolate_pos_emb, rope_2d_angles
from kdsa.model.vision.projector import merge_patches
from kdsa.model.vision.tower import VisionTower

VC = get_preset("tiny-vl").vision_config


@pytest.mark.parametrize("h, w, grid", [(1, 1, (2, 2)), (14, 14, (2, 2)), (28, 28, (2, 2)),
                                        (29, 28, (4, 2)), (15, 57, (2, 6)), (100, 3, (8, 2))])
def test_patch_grid_odd_sizes(h, w, grid):
    assert patch_grid(h, w, 14) == grid
    im = patchify(np.full((h, w, 3), 255, np.uint8), VC)
    assert im.grid == grid and im.num_patches == grid[0] * grid[1]
    assert im.num_tokens == im.num_patches // 4 and im.size == (w, h)
    # the image itself is +1 (white), the padding to whole merge windows is -1 (black pixels,
    # as the K2.5/K3 processor pads before normalising)
    full = np.full((grid[0] * 14, grid[1] * 14), -1.0, np.float32)
    full[:h, :w] = 1.0
    for (r, c), p in zip(im.pos, im.patches):
        np.testing.assert_array_equal(p.reshape(3, 14, 14)[0], full[r * 14:(r + 1) * 14,
                                                                     c * 14:(c + 1) * 14])


def test_patch_layout_is_channel_row_col():
    px = np.random.default_rng(0).integers(0, 256, (28, 28, 3)).astype(np.uint8)
    im = patchify(px, VC)
    i = next(k for k, (r, c) in enumerate(im.pos) if (r, c) == (1, 0))
    ref = (px[14:28, 0:14].astype(np.float32) / 255 - 0.5) / 0.5       # [14, 14, 3]
    np.testing.assert_allclose(im.patches[i].reshape(3, 14, 14), ref.transpose(2, 0, 1),
                               rtol=1e-6)


def test_large_images_are_downscaled_like_the_processor():
    """tiny-vl: max_patches (in_patch_limit) 1024, 64 patches per side. Expected sizes worked
    out by hand from navit_resize_image (K2.5/K3 media_utils): 470 x 470 px has 33 x 33 whole
    patches > 1024, scale sqrt(1024 / 1089), int(470 * 0.9697) = 455 px, padded to 34 x 34
    patches (the padding may exceed the limit, as in the reference); 2000 x 20 px hits the
    side limit, scale 64 * 14 / 2000: 896 x 8 px -> 64 x 2 patches."""
    px = np.random.default_rng(3).integers(0, 256, (470, 470, 3)).astype(np.uint8)
    im = patchify(px, VC)
    assert im.grid == (34, 34) and im.size == (470, 470)
    want = np.asarray(Image.fromarray(px).resize((455, 455), Image.BICUBIC), np.float32)
    canvas = np.full((34 * 14, 34 * 14, 3), -1.0, np.float32)
    canvas[:455, :455] = want / 127.5 - 1.0
    for (r, c), p in zip(im.pos[:50], im.patches[:50]):
        np.testing.assert_allclose(p.reshape(3, 14, 14),
                                   canvas[r * 14:(r + 1) * 14, c * 14:(c + 1) * 14]
                                   .transpose(2, 0, 1), atol=1e-6)
    assert patchify(np.zeros((20, 2000, 3), np.uint8), VC).grid == (2, 64)
    assert patchify(np.zeros((20, 2000, 3), np.float32), VC).grid == (2, 64)  # float path
    k3 = get_preset("k3-2.8t").vision_config                  # 65536 / 512: 640x480 untouched
    assert patchify(np.zeros((480, 640, 3), np.uint8), k3).grid == (36, 46)


def test_bad_pixels():
    with pytest.raises(ValueError, match=r"\[height, width, 3\]"):
        patchify(np.zeros((20, 20), np.uint8), VC)
    with pytest.raises(ValueError, match="finite values in"):
        patchify(np.full((20, 20, 3), np.nan, np.float32), VC)


def test_transparency_is_composited_onto_the_chessboard():
    rgba = np.zeros((20, 20, 4), np.uint8)
    rgba[..., 0], rgba[:, 10:, 3] = 200, 255          # red 200; left half fully transparent
    rgba[0, 12, 3] = 128                              # one half-transparent pixel
    out = decode_image(base64.b64decode(to_data_url_rgba(rgba)))
    want_bg = np.array([[255 if ((y // 8) + (x // 8)) % 2 == 0 else 180 for x in range(10)]
                        for y in range(20)])
    for c in range(3):
        np.testing.assert_array_equal(out[:, :10, c], want_bg)
    assert out[5, 15].tolist() == [200, 0, 0]
    a = 128 / 255                                      # background at (0, 12): gray (square 1)
    g = round(180 * (1 - a))
    assert out[0, 12].tolist() == [round(200 * a + 180 * (1 - a)), g, g]


def test_sixteen_bit_grayscale_is_scaled_not_clipped():
    """A 16-bit grayscale PNG (Pillow mode I;16) decodes to value / 257, its transparent gray
    value onto the chessboard; a float TIFF is refused by name."""
    gray = np.array([[0, 257, 30000, 65535]], np.uint16)
    buf = io.BytesIO()
    Image.fromarray(gray).save(buf, "PNG")
    out = decode_image(buf.getvalue())
    assert out[..., 0].tolist() == [[0, 1, 117, 255]] and (out[..., 1] == out[..., 0]).all()
    buf = io.BytesIO()
    Image.fromarray(gray).save(buf, "PNG", transparency=30000)
    assert decode_image(buf.getvalue())[0, 2].tolist() == [255, 255, 255]  # chessboard white
    buf = io.BytesIO()
    Image.fromarray(np.full((2, 2), 0.5, np.float32)).save(buf, "TIFF")
    with pytest.raises(ValueError, match="mode F"):
        decode_image(buf.getvalue(), "image 1")


def test_only_the_api_image_formats_are_decoded():
    """PNG, JPEG, WebP and GIF decode; in a request's data URL another format Pillow reads (BMP
    here; EPS would run Ghostscript) is refused before any plugin of its own opens it; local
    files (``kdsa generate``, SFT data) may be in any format."""
    rgb = np.full((16, 16, 3), 90, np.uint8)
    for fmt in ("PNG", "JPEG", "WEBP", "GIF"):
        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, fmt)
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        assert image_from_url(url).shape == (16, 16, 3), fmt
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "BMP")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    with pytest.raises(ValueError, match="cannot decode the image"):
        image_from_url(url)
    assert decode_image(buf.getvalue()).shape == (16, 16, 3)  # a local file: any format


def test_pillows_own_refusals_name_the_image():
    """A PNG whose compressed text chunk inflates past Pillow's limit: Pillow's own ValueError
    came back without the request's location; it is now named like every other refusal."""
    from PIL import PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text("note", "x" * (PngImagePlugin.MAX_TEXT_CHUNK + 1), zip=True)
    buf = io.BytesIO()
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(buf, "PNG", pnginfo=info)
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content\[1\]: cannot decode the "
                                         r"image \(Decompressed data too large"):
        decode_image(buf.getvalue(), "messages[0].content[1]")


def to_data_url_rgba(rgba):
    """RGBA uint8 -> base64 PNG bytes."""
    buf = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buf, "PNG")
    return base64.b64encode(buf.getvalue())


def _bilinear_reference(table: np.ndarray, oh: int, ow: int) -> np.ndarray:
    """PyTorch bilinear (align_corners=False) written out pixel by pixel."""
    ih, iw, d = table.shape
    out = np.zeros((oh, ow, d), np.float64)
    for i in range(oh):
        sy = max((i + 0.5) * ih / oh - 0.5, 0.0)
        y0 = min(int(np.floor(sy)), ih - 1)
        y1 = y0 + 1 if y0 < ih - 1 else y0
        ly = sy - y0
        for j in range(ow):
            sx = max((j + 0.5) * iw / ow - 0.5, 0.0)
            x0 = min(int(np.floor(sx)), iw - 1)
            x1 = x0 + 1 if x0 < iw - 1 else x0
            lx = sx - x0
            out[i, j] = ((1 - ly) * ((1 - lx) * table[y0, x0] + lx * table[y0, x1])
                         + ly * ((1 - lx) * table[y1, x0] + lx * table[y1, x1]))
    return out


def _interp(table, gh, gw):
    r, c = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
    pos = np.stack([r, c], -1).reshape(-1, 2)
    grid = np.broadcast_to(np.array([gh, gw]), pos.shape)
    return np.asarray(interpolate_pos_emb(jnp.asarray(table), pos, grid)).reshape(gh, gw, -1)


@pytest.mark.parametrize("gh, gw", [(5, 11), (2, 2), (16, 6), (13, 8), (1, 3)])
def test_pos_emb_interpolation_matches_numpy_reference(gh, gw):
    table = np.random.default_rng(1).normal(size=(8, 8, 5)).astype(np.float32)
    np.testing.assert_allclose(_interp(table, gh, gw), _bilinear_reference(table, gh, gw),
                               rtol=1e-5, atol=1e-5)


def test_pos_emb_interpolation_identity_and_pil_upsampling():
    table = np.random.default_rng(2).normal(size=(8, 8, 3)).astype(np.float32)
    np.testing.assert_array_equal(_interp(table, 8, 8), table)  # sizes match: the table
    ours = _interp(table, 20, 12)
    for ch in range(3):  # PIL's bilinear resize (upsampling: no antialias support widening)
        pil = Image.fromarray(table[..., ch], mode="F").resize((12, 20), Image.Resampling.BILINEAR)
        np.testing.assert_allclose(ours[..., ch], np.asarray(pil), rtol=1e-4, atol=1e-4)


def test_rope_2d_matches_complex_reference():
    rng = np.random.default_rng(3)
    p, h, d, theta = 7, 2, 16, 10000.0
    x = rng.normal(size=(p, h, d)).astype(np.float32)
    pos = rng.integers(0, 40, (p, 2)).astype(np.int32)
    ours = np.asarray(apply_rope_2d(jnp.asarray(x), rope_2d_angles(jnp.asarray(pos), d, theta)))
    ref = np.zeros_like(x)
    for i in range(p):
        for j in range(d // 2):
            k, coord = j // 2, pos[i, 1] if j % 2 == 0 else pos[i, 0]  # even pairs: column
            z = (x[i, :, 2 * j] + 1j * x[i, :, 2 * j + 1]) * np.exp(
                1j * coord * theta ** (-4 * k / d))
            ref[i, :, 2 * j], ref[i, :, 2 * j + 1] = z.real, z.imag
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)
    # relative: q.k depends only on the 2-D offset
    q, k = jnp.asarray(x[:1]), jnp.asarray(x[1:2])
    def dot(pq, pk):
        a = apply_rope_2d(q, rope_2d_angles(jnp.asarray([pq]), d))
        b = apply_rope_2d(k, rope_2d_angles(jnp.asarray([pk]), d))
        return np.asarray(jnp.sum(a * b, -1))
    np.testing.assert_allclose(dot((3, 5), (1, 9)), dot((13, 2), (11, 6)), rtol=1e-4, atol=1e-4)


def test_merge_order_matches_raster_permutation():
    gh, gw, d = 4, 6, 3
    raster = np.arange(gh * gw * d, dtype=np.float32).reshape(gh, gw, d)
    ref = raster.reshape(gh // 2, 2, gw // 2, 2, d).transpose(0, 2, 1, 3, 4).reshape(-1, 4 * d)
    pos = merge_order(gh, gw)
    ours = merge_patches(jnp.asarray(raster[pos[:, 0], pos[:, 1]])[None], 4)[0]
    np.testing.assert_array_equal(np.asarray(ours), ref)


@pytest.fixture(scope="module")
def tower():
    return VisionTower(VC, rngs=nnx.Rngs(0))


def test_packed_images_equal_each_alone(tower):
    rng = np.random.default_rng(4)
    ims = [patchify(rng.integers(0, 256, s + (3,)).astype(np.uint8), VC)
           for s in [(30, 45), (14, 20), (56, 28)]]
    run = nnx.jit(lambda t, b: t(b.patches, b.pos, b.grid, b.segment))
    packed = run(tower, jax.tree.map(jnp.asarray, pack_images([ims], 64)))[0]
    at = 0
    for im in ims:
        alone = run(tower, jax.tree.map(jnp.asarray, pack_images([[im]], 64)))[0]
        np.testing.assert_allclose(packed[at:at + im.num_patches], alone[:im.num_patches],
                                   rtol=2e-5, atol=2e-5)
        at += im.num_patches
    # a different patch order (raster instead of merge order) permutes the outputs only
    im = ims[0]
    perm = np.random.default_rng(5).permutation(im.num_patches)
    shuffled = type(im)(im.patches[perm], im.pos[perm], im.grid, im.size, im.merge_size)
    out = run(tower, jax.tree.map(jnp.asarray, pack_images([[shuffled]], 64)))[0]
    base = run(tower, jax.tree.map(jnp.asarray, pack_images([[im]], 64)))[0]
    np.testing.assert_allclose(out[:im.num_patches], base[perm], rtol=2e-5, atol=2e-5)


def test_blocked_attention_equals_the_dense_reference_values_and_gradients():
    """The tiled online softmax against the one-softmax reference: several images per row, a
    row length no block divides, padding (id 0), gradients of q, k, v."""
    rng = np.random.default_rng(6)
    b, p, h, d = 2, 45, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(b, p, h, d)), jnp.float32) for _ in range(3))
    segment = np.zeros((b, p), np.int32)
    segment[0, :7], segment[0, 7:30], segment[0, 30:41] = 1, 2, 3  # 41-44 padding
    segment[1, :45] = np.repeat([-1, 2], [20, 25])  # any ids: -1 too (the tiles' own padding
    # once used -1, and mixed with such a caller's patches)
    segment = jnp.asarray(segment)
    ref = vision_attention_dense(q, k, v, segment)
    for block in (8, 16):
        out = vision_attention_blocked(q, k, v, segment, block=block)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)

    def loss(fn, q, k, v):
        return jnp.sum(jnp.sin(fn(q, k, v, segment)))

    g_ref = jax.grad(lambda *a: loss(vision_attention_dense, *a), argnums=(0, 1, 2))(q, k, v)
    g = jax.grad(lambda *a: loss(lambda *x: vision_attention_blocked(*x, block=8), *a),
                 argnums=(0, 1, 2))(q, k, v)
    for x, y in zip(g, g_ref):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)


def test_blocked_attention_skips_the_blocks_of_other_images():
    """A key block of another image is not read: NaN values there leave the first image's
    outputs finite (the dense reference multiplies them by 0 and gives NaN)."""
    b, p, h, d = 1, 32, 1, 4
    q = k = jnp.ones((b, p, h, d), jnp.float32)
    v = jnp.ones((b, p, h, d), jnp.float32).at[:, 16:].set(jnp.nan)
    segment = jnp.asarray(np.repeat([1, 2], 16)[None], jnp.int32)
    out = vision_attention_blocked(q, k, v, segment, block=8)
    np.testing.assert_array_equal(np.asarray(out[0, :16]), 1.0)
    assert np.isnan(np.asarray(vision_attention_dense(q, k, v, segment)[0, :16])).all()


def test_tower_with_tiled_attention_equals_the_dense_tower(tower, monkeypatch):
    rng = np.random.default_rng(7)
    ims = [patchify(rng.integers(0, 256, s + (3,)).astype(np.uint8), VC)
           for s in [(30, 45), (14, 20), (56, 28)]]
    batch = jax.tree.map(jnp.asarray, pack_images([ims], 64))
    dense = tower(batch.patches, batch.pos, batch.grid, batch.segment)
    monkeypatch.setattr(vision_attention_module, "BLOCK", 8)  # image 1 spans 2 tiles
    tiled = tower(batch.patches, batch.pos, batch.grid, batch.segment)
    np.testing.assert_allclose(tiled, dense, rtol=2e-5, atol=2e-5)


def test_scatter_features_lands_at_placeholders():
    feats = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3) + 1
    mask = np.zeros((2, 9), bool)
    mask[0, [1, 2, 6]] = True
    mask[1, [0, 3, 4, 8]] = True
    out = np.asarray(scatter_features(feats, jnp.asarray(mask)))
    for b in range(2):
        np.testing.assert_array_equal(out[b][mask[b]], np.asarray(feats[b, :mask[b].sum()]))
        assert not out[b][~mask[b]].any()


def test_sharding_rules_cover_the_tower():
    from kdsa.model.count import abstract_model
    from kdsa.sharding.mesh import make_mesh
    from kdsa.sharding.rules import logical_to_spec, get_rules, variable_axes

    model = abstract_model(get_preset("tiny-vl"))
    mesh = make_mesh({"fsdp": 2, "tensor": 4})
    for layout in ("train", "generate"):
        specs = {}
        for path, v in list(nnx.to_flat_state(nnx.state(model.vision_tower))) + list(
                nnx.to_flat_state(nnx.state(model.mm_projector))):
            specs[".".join(map(str, path))] = logical_to_spec(variable_axes(v), v.shape, mesh,
                                                              get_rules(layout))
        assert tuple(specs["encoder.blocks.0.wqkv.kernel"]) == (
            ("fsdp" if layout == "train" else None), "tensor")
        assert tuple(specs["encoder.blocks.1.mlp.fc1.kernel"]) == (
            "tensor", "fsdp" if layout == "train" else None)
        assert tuple(specs["proj.2.kernel"])[0] == "tensor"


# K3's published vision_config (config.json, revision recorded in kimi_k3.md; the same values in
# lightseekorg/tokenspeed python/tokenspeed/runtime/configs/kimi_k3_config.py
# KimiK3VisionConfig, "defaults verbatim from config.json")
K3_PUBLISHED = {"patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64,
                "init_pos_emb_time": 4, "pos_emb_type": "divided_fixed",
                "pos_emb_interpolation_mode": "bilinear", "vt_num_attention_heads": 12,
                "vt_num_hidden_layers": 27, "vt_hidden_size": 1024, "vt_intermediate_size": 4096,
                "qkv_hidden_size": 1536, "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
                "mm_projector_type": "patchmergerv2", "projector_hidden_act": "gelu",
                "projector_ln_eps": 1e-5, "norm_type": "rmsnorm", "attn_bias": False,
                "patch_embed_proj_bias": False, "mlp_type": "mlp2", "linear_bias": False,
                "activation_func": "gelu_pytorch_tanh", "text_hidden_size": 7168}


def test_k3_preset_matches_the_published_vision_config():
    from kdsa.model.config import VisionConfig

    ours = get_preset("k3-2.8t").vision_config
    assert VisionConfig.from_hf(K3_PUBLISHED) == ours
    # vLLM builds the tower norms as nn.RMSNorm(dim): eps = finfo(bfloat16).eps in the bf16
    # checkpoint; no biases anywhere in the K3 tower
    assert ours.norm_eps == 2.0 ** -7 and not (ours.attn_bias or ours.linear_bias
                                               or ours.patch_embed_proj_bias)
    with pytest.raises(ValueError, match="only 'bilinear'"):
        VisionConfig.from_hf(dict(K3_PUBLISHED, pos_emb_interpolation_mode="bicubic"))
