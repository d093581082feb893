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

``kdsa train --data FILE.jsonl`` reads such a file when its lines are ``{"messages": ...}``
objects (:func:`is_chat_jsonl`, :func:`chat_sft_data`): tokens from the byte tokenizer and the
``xtml`` chat format (K3's), image files relative to the JSONL, and every error names the file
and line. Conversations without images train a text-only model too; an image for a model
without a vision tower is an error naming the line.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kdsa.infer.chat import Message, messages_from_openai
from kdsa.infer.jsonl import read_records
from kdsa.model.vision.assemble import batch_arrays, check_placeholders, pack_images
from kdsa.model.vision.inputs import ImageLimits, file_parts, make_image_loader
from kdsa.train.chat_rows import conversation_row
from kdsa.train.data import data_fingerprint


def render_example(messages: list[Message], chat_format) -> tuple[list[int], int]:
    """``(ids, prompt_len)``: the whole conversation and where the trained answer (its last
    assistant turn, ``chat_rows.conversation_row``) starts."""
    if not messages or messages[-1].role != "assistant":
        raise ValueError("an SFT example must end with the assistant answer")
    said = [i for i, m in enumerate(messages) if m.role == "assistant" and m.reasoning]
    if said:  # rendered without thinking, any turn's reasoning would be dropped silently
        raise ValueError(f"message {said[0]} has reasoning_content, which chat SFT rows do not "
                         f"hold (they are rendered without thinking); remove it")
    ids, mask = conversation_row(chat_format, messages, len(messages) - 1, thinking=False)
    return ids, mask.index(1.0) if 1.0 in mask else len(ids)


class ImageSftData:
    """Rows of chat examples (module doc). ``vision`` None: a text-only model (an image is an
    error). ``names``: how errors name each example (default ``example N``)."""

    def __init__(self, examples: list, chat_format, vision, *, batch_size: int, seq_len: int,
                 seed: int = 0, patches_per_row: int | None = None, base_dir=None,
                 limits: ImageLimits = ImageLimits(), names: list[str] | None = None):
        rows, images = [], []
        for n, ex in enumerate(examples):
            where = names[n] if names is not None else f"example {n}"
            try:
                if not isinstance(ex, dict) or not isinstance(ex.get("messages"), list):
                    raise ValueError("expected an object with a 'messages' list")
                load = None if vision is None else make_image_loader(vision, limits, base_dir)
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
        self.vision = vision
        need = max(sum(im.num_patches for im in ims) for ims in images)
        self.patches = patches_per_row or max(8, -(-need // 8) * 8)
        n, t = len(rows), seq_len + 1
        self.tokens = np.zeros((n, t), np.int32)
        self.answer = np.zeros((n, t), bool)  # positions whose token is trained
        self.valid = np.zeros((n, t), bool)
        for r, (ids, start) in enumerate(rows):
            self.tokens[r, :len(ids)] = ids
            self.valid[r, :len(ids)] = True
            self.answer[r, start:len(ids)] = True
        if vision is not None:
            check_placeholders(self.tokens, images, vision.media_placeholder_token_id)
        self.images = images
        self.feature_size = None if vision is None else 3 * vision.patch_size ** 2
        self.batch_size, self.seed = batch_size, seed
        self.batches_per_epoch = n // batch_size
        self.fingerprint = data_fingerprint("chat", self.tokens, self.answer, self.valid, *(
            im.patches for ims in images for im in ims))

    def batch(self, index: int) -> dict[str, np.ndarray]:
        epoch, k = divmod(index, self.batches_per_epoch)
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.tokens))
        rows = perm[k * self.batch_size:(k + 1) * self.batch_size]
        tok, valid = self.tokens[rows], self.valid[rows]
        out = {"inputs": tok[:, :-1], "targets": tok[:, 1:],
               "loss_mask": self.answer[rows][:, 1:].astype(np.float32),
               "segment_ids": valid[:, :-1].astype(np.int32)}
        if self.vision is None:
            return out
        packed = pack_images([self.images[r] for r in rows], self.patches, self.feature_size)
        return out | batch_arrays(packed)


def read_image_sft_jsonl(path, chat_format, vision, **kw) -> ImageSftData:
    """:class:`ImageSftData` from a JSONL file; image paths are relative to its directory;
    errors name ``FILE:LINE``."""
    path = Path(path)
    recs = list(read_records(path))
    return ImageSftData([r for _, r in recs], chat_format, vision, base_dir=path.parent,
                        names=[f"{path}:{n}" for n, _ in recs], **kw)


def is_chat_jsonl(path) -> bool:
    """Whether the first record of a JSONL file is a chat example (``{"messages": ...}``)."""
    for _, rec in read_records(path):
        return isinstance(rec, dict) and "messages" in rec
    return False


def chat_sft_data(config, tc, path, limits: ImageLimits = ImageLimits(),
                  tokenizer=None) -> ImageSftData:
    """``kdsa train --data`` on a chat JSONL: the ``xtml`` format over ``tokenizer`` (the
    model's own, ``--init-from``; default: the byte tokenizer of the model's vocabulary),
    ``tc.batch_size`` rows of ``tc.seq_len``, shuffled with ``tc.seed``."""
    from kdsa.infer.chat import get_format
    from kdsa.infer.tokenizer import load_tokenizer

    tok = tokenizer or load_tokenizer(None, vocab_size=config.vocab_size)
    vc = config.vision_config
    pad = tok.special_tokens.get("<|media_pad|>")
    if vc is not None and pad != vc.media_placeholder_token_id:
        raise ValueError(f"vision_config.media_placeholder_token_id="
                         f"{vc.media_placeholder_token_id} is not the byte tokenizer's "
                         f"<|media_pad|> ({pad})")
    return read_image_sft_jsonl(path, get_format("xtml", tok), vc, batch_size=tc.batch_size,
                                seq_len=tc.seq_len, seed=tc.seed, limits=limits)
