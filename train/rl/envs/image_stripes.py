"""``image_stripes``: RL with image prompts. Which way do the stripes run? (``docs/vision.md``)

Each task is one synthetic image of black-and-white stripes, horizontal or vertical (random
stripe width 2..5 px and phase, a coin flip for the direction, deterministic in ``(seed,
split, index)``), with the question ``Horizontal or vertical stripes? Answer h or v.``.
The answer is verifiable: reward 1 when the reply's content, stripped and lower-cased, is the
right letter (``h`` / ``v``) or word, else 0.

The image is patched for the preset ``vision_preset`` (option; patch size, merge and limits --
14 px and 2 x 2 for every preset here), so the task's user message carries it as an image part;
the rollout hands it to the engine with the prompt and the training batch carries it for the
policy forward (``train/rl/rollout.py``). All images have ``size x size`` pixels (option,
default 28: one merged token), so every training batch has the same image shape.
"""

from __future__ import annotations

import numpy as np

from kdsa.infer.chat import AssistantOutput, Message
from kdsa.train.rl.envs.base import Environment, Outcome, Task, register_env

QUESTION = "Horizontal or vertical stripes? Answer h or v."
ANSWERS = {"h": ("h", "horizontal"), "v": ("v", "vertical")}


def stripes(rng: np.random.Generator, horizontal: bool, size: int) -> np.ndarray:
    """``[size, size, 3]`` uint8 black/white stripes of random width (2..5, at most half the
    image, so both colours show: a 4-pixel image with 5-pixel stripes was one colour, with no
    answer) and phase."""
    w, phase = int(rng.integers(2, min(6, size // 2 + 1))), int(rng.integers(0, 12))
    band = ((np.arange(size) + phase) // w) % 2 * 255
    img = np.broadcast_to(band[:, None, None], (size, size, 3)).astype(np.uint8)
    return img if horizontal else img.transpose(1, 0, 2).copy()


@register_env("image_stripes")
class ImageStripes(Environment):
    def __init__(self, *, seed: int = 0, vision_preset: str = "tiny-vl", size: int = 28,
                 **kwargs):
        super().__init__(seed=seed, **kwargs)
        from kdsa.model.config import get_preset

        self.vision = get_preset(vision_preset).vision_config
        if self.vision is None:
            raise ValueError(f"environment {self.name!r}: vision_preset {vision_preset!r} has "
                             f"no vision tower")
        if not isinstance(size, int) or size < 4:
            raise ValueError(f"environment {self.name!r}: size must be an integer >= 4 pixels, "
                             f"got {size!r}")
        self.size = size

    def task(self, index: int, split: str = "train") -> Task:
        from kdsa.model.vision.patching import patchify

        rng = np.random.default_rng([self.split_seed(split), index])
        horizontal = bool(rng.integers(2))
        image = patchify(stripes(rng, horizontal, self.size), self.vision)
        msg = Message("user", QUESTION, parts=(image, QUESTION))
        return Task(self.name, index, (msg,), data="h" if horizontal else "v")

    def respond(self, task: Task, output: AssistantOutput,
                history: tuple[Message, ...]) -> Outcome:
        said = output.content.strip().lower().rstrip(".")
        right = said in ANSWERS[task.data]
        return Outcome(reward=float(right), metrics={"answered": float(
            any(said in a for a in ANSWERS.values()))})
