"""Rotary position embedding that follows its module's device instead of assuming CUDA.

megatron-core's ``RotaryEmbedding`` keeps ``inv_freq`` as a plain attribute (not a buffer, so
``module.to()`` leaves it behind) and, on the first forward, moves it to
``torch.cuda.current_device()`` -- which fails on a CPU-only machine. This subclass computes
exactly the same embedding but (a) carries ``inv_freq`` along with device moves of the module,
never its dtype casts (megatron keeps the frequencies in fp32 even in a bf16 model), and
(b) builds the embedding on whatever device ``inv_freq`` is on.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding


class DeviceAgnosticRotaryEmbedding(RotaryEmbedding):
    """``RotaryEmbedding`` without the hard-coded CUDA move."""

    def _apply(self, fn, recurse=True):
        # Learn the target device from a probe: ``fn`` may also cast dtypes, which we ignore.
        probe = fn(torch.empty(0, dtype=torch.float32, device=self.inv_freq.device))
        if probe.device != self.inv_freq.device:
            self.inv_freq = self.inv_freq.to(probe.device)
            # ``forward`` is lru-cached per (module, length); drop embeddings on the old device.
            RotaryEmbedding.forward.cache_clear()
        return super()._apply(fn, recurse)

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """``[s, 1, 1, dim]`` rotation angles, same layout as megatron's."""
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # [s, dim / 2]
        if self.rotary_interleaved:
            # f0 f0 f1 f1 ...
            emb = torch.stack((freqs, freqs), dim=-1).reshape(freqs.size(0), -1)
        else:
            # f0 f1 ... f0 f1 ...
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]


def make_rotary_device_agnostic(
    model: torch.nn.Module, rotary_percent: float = 1.0, rotary_base: int = 10000
) -> None:
    """Swap a GPT model's ``rotary_pos_emb`` for the device-agnostic version, in place.

    Rebuilt from the model's own config with the percent and base the model was built with
    (``--rotary-percent``, ``--rotary-base``; no scaling); the frequencies are checked to be
    identical so a drift in megatron's defaults cannot go unnoticed.
    """
    old = getattr(model, "rotary_pos_emb", None)
    if old is None or type(old) is not RotaryEmbedding:
        return
    config = model.config
    new = DeviceAgnosticRotaryEmbedding(
        kv_channels=config.kv_channels,
        rotary_percent=rotary_percent,
        rotary_base=rotary_base,
        rotary_interleaved=config.rotary_interleaved,
        seq_len_interpolation_factor=old.seq_len_interpolation_factor,
        use_cpu_initialization=True,
        cp_group=old.cp_group,
    )
    if not torch.equal(new.inv_freq, old.inv_freq.to(new.inv_freq.device)):
        raise RuntimeError("rebuilt rotary embedding differs from megatron's; update the seam")
    model.rotary_pos_emb = new
