"""Nodes that lie, for tests of the gateway's checks (``--faulty-outputs``; testing only, never for serving).

Two kinds. *Malformed* replies (``nan``, ``shape``, ``dtype``) fail the gateway's reply checks at once: the
handlers corrupt what they send (``SpanHandlers._corrupt``). *Healthy-looking* ones answer well-formed hidden
states of the right shape, dtype and scale that are simply wrong, so only a comparison with another replica (the
gateway's probation and spot checks) or the node's own self-test can tell:

* ``noise``: every forward's output plus 1 % relative Gaussian noise (per row, scaled to its RMS);
* ``stale-cache``: keys and values never reach the session's cache (each forward's are dropped after it), the
  failure a transformers whose layers swallow our cache keyword produced; the self-test catches it;
* ``wrong-weights``: the span's first block computes with weights from another seed; consistent with itself, so
  the self-test passes it and probation must catch it;
* ``low-precision``: announces the quantization it was asked for (``--quant none`` on a CPU) but computes NF4;
* ``lazy``: answers its input unchanged (the cheapest lie).

And one that computes right but cannot be held to it: ``bad-receipt`` signs its step receipts (``shared.receipts``)
with a key of its own that the certificate it sends at open does not name; the gateway must refuse its replies.
``forward-shape`` serves sessions right and answers stateless forwards — what a gateway asks a reference replica
while it checks another node — with a wrong shape (``SpanHandlers._forward``): a liar only in the reference's role.
``forward-noise`` is the same liar with plausible values (``noise``'s), which only a comparison can tell.

``noise`` and ``lazy`` act in ``SpanBackend._forward`` (every step, batched, pushed or stateless), the others in how
the span is built or run, so every path a request can take lies the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from shared.identity import registered_identity
from shared.receipts import StepKey
from swarm_node.quantize import Quant
from swarm_node.span import BlockTransform

NOISE_RELATIVE = 0.01  # ``noise``: the noise's RMS over the output row's RMS
WRONG_WEIGHTS_SEED = 20261201  # ``wrong-weights``: the seed the replaced block's weights are drawn from


def lie_about(fault: str, inputs: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """What a ``noise`` or ``lazy`` node answers for a forward of ``inputs`` whose true answer is ``output``."""
    if fault == "noise":
        rms = output.float().pow(2).mean(dim=-1, keepdim=True).sqrt()
        return (output.float() + NOISE_RELATIVE * rms * torch.randn_like(output, dtype=torch.float32)).to(output.dtype)
    if fault == "lazy":
        return inputs.to(output.dtype).clone()
    return output


def receipt_keys(fault: str, peer_id: str) -> tuple[StepKey, StepKey]:
    """The step key the node certifies at open, and the key its receipts are signed with: the same one, except for
    a ``bad-receipt`` node."""
    peer_key = registered_identity(peer_id).key
    certified = StepKey(peer_key)
    return certified, StepKey(peer_key) if fault == "bad-receipt" else certified


def computed_quant(fault: str, announced: Quant) -> Quant:
    """The quantization the span is built with: NF4 for a ``low-precision`` node, whatever it announces."""
    return "nf4" if fault == "low-precision" else announced


def wrong_weights(transform: BlockTransform | None) -> BlockTransform:
    """A block transform that first redraws the first block's floating-point weights from another seed (each
    tensor keeping its mean and standard deviation, so the block's scale looks right), then applies ``transform``."""
    seen = 0

    def apply(block: nn.Module) -> nn.Module:
        nonlocal seen
        if seen == 0:
            _redraw(block)
        seen += 1
        return block if transform is None else transform(block)

    return apply


def _redraw(block: nn.Module) -> None:
    generator = torch.Generator().manual_seed(WRONG_WEIGHTS_SEED)
    with torch.no_grad():
        for parameter in block.parameters():
            if parameter.is_floating_point() and parameter.numel() > 1:
                std, mean = float(parameter.float().std()), float(parameter.float().mean())
                if std == 0:  # a norm's ones: nothing a seed would draw differently
                    continue
                drawn = torch.randn(parameter.shape, generator=generator) * std + mean
                parameter.copy_(drawn.to(parameter.dtype))
