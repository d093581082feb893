"""SFT data with images: chat examples whose user turns hold images, one example per row.

An example is a conversation (OpenAI message JSON) ending with the assistant answer to learn::

    {"messages": [{"role": "user", "content": [
                       {"type": "text", "text": "Which stripes?"},
                       {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},
                       {"type": "image", "path": "img/0001.png"}]},       # file, relative
                  {"role": "assistant", "content": "horizontal"}]}

The prompt (everything before the answer, rendered by the chat format with thinking off) and the
answer are rendered; the loss covers the answer's tokens (its content and end of message) only.
Images are patched (``model/vision/patching.py``) into the row's ``image_*`` arrays
(``model/vision/assemble.py : pack_images``), which ``train_step`` runs through the tower; the
row's ``<|media_pad|>`` placeholders take the features. Rows are padded to ``seq_len + 1``
tokens and ``patches_per_row`` patch slots; an example that does not fit is an error naming it.
Like the other sources, ``batch(i)`` is a pure function of the batch index (shuffled per epoch).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kdsa.infer.chat import Message, messages_from_openai
from kdsa.model.vision.assemble import batch_arrays, check_placeholders, pack_images
from kdsa.model.vision.inputs import ImageLimits, file_parts, make_image_loader


def render_example(messages: list[Message], chat_format) -> tuple[list[int], int]:
    """``(ids, prompt_len)``: the whole conversation and where the answer starts."""
    if not messages or messages[-1].role != "assistant":
        raise ValueError("an SFT example must end with the assistant answer")
    prompt = chat_format.render(messages[:-1], thinking=False)
    full = chat_format.render(messages, thinking=False, add_generation_prompt=False)
    if full[:len(prompt)] != prompt:
        raise ValueError("the rendered answer does not extend the rendered prompt")
    return full, len(prompt)


class ImageSftData:
    def __init__(self, examples: list, chat_format, vision, *, batch_size: int, seq_len: int,
                 seed: int = 0, patches_per_row: int | None = None, base_dir=None,
                 limits: ImageLimits = ImageLimits()):
        if vision is None:
            raise ValueError("image SFT data needs a model with a vision_config")
        rows, images = [], []
        for n, ex in enumerate(examples):
            where = f"example {n}"
            try:
                load = make_image_loader(vision, limits, base_dir)
                msgs = messages_from_openai(file_parts(ex["messages"]), load)
                ims = [im for m in msgs for im in m.images]
                ids, start = render_example(msgs, chat_format)
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{where}: {e}") from None
            if len(ids) > seq_len + 1:
                raise ValueError(f"{where}: {len(ids)} tokens, more than seq_len + 1 = "
                                 f"{seq_len + 1}")
            rows.append((ids, start))
            images.append(ims)
        if len(rows) < batch_size:
            raise ValueError(f"{len(rows)} examples, fewer than batch_size={batch_size}")
        need = max(sum(im.num_patches for im in ims) for ims in images)
        self.patches = patches_per_row or max(8, -(-need // 8) * 8)
        ph = vision.media_placeholder_token_id
        n, t = len(rows), seq_len + 1
        self.tokens = np.zeros((n, t), np.int32)
        self.answer = np.zeros((n, t), bool)  # positions whose token is trained
        self.valid = np.zeros((n, t), bool)
        for r, (ids, start) in enumerate(rows):
            self.tokens[r, :len(ids)] = ids
            self.valid[r, :len(ids)] = True
            self.answer[r, start:len(ids)] = True
        check_placeholders(self.tokens, images, ph)
        self.images, self.feature_size = images, 3 * vision.patch_size ** 2
        self.batch_size, self.seed = batch_size, seed
        self.batches_per_epoch = n // batch_size

    def batch(self, index: int) -> dict[str, np.ndarray]:
        epoch, k = divmod(index, self.batches_per_epoch)
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.tokens))
        rows = perm[k * self.batch_size:(k + 1) * self.batch_size]
        tok, valid = self.tokens[rows], self.valid[rows]
        out = {"inputs": tok[:, :-1], "targets": tok[:, 1:],
               "loss_mask": self.answer[rows][:, 1:].astype(np.float32),
               "segment_ids": valid[:, :-1].astype(np.int32)}
        packed = pack_images([self.images[r] for r in rows], self.patches, self.feature_size)
        return out | batch_arrays(packed)


def read_image_sft_jsonl(path, chat_format, vision, **kw) -> ImageSftData:
    """:class:`ImageSftData` from a JSONL file; image paths are relative to its directory."""
    path = Path(path)
    examples = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                examples.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
    return ImageSftData(examples, chat_format, vision, base_dir=path.parent, **kw)
