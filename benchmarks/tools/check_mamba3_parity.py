"""Load a mamba_ssm 2.3.2 Mamba3 (SISO) layer's weights into megacpp's Mamba3 and compare outputs.

    PYTHONPATH=.:.peers/mamba_src python benchmarks/tools/check_mamba3_parity.py

Needs a CUDA GPU (mamba_ssm's kernels are Triton) and the mamba_ssm source on PYTHONPATH. The peer is
built with its own initialisation, perturbed so no parameter sits at a special value, converted with
`megacpp.model.mamba3_convert.from_mamba_ssm` and loaded strictly; both run the same fp32 input.
mamba_ssm's kernels approximate tanh/sin/cos and reduce angles per chunk, so agreement is expected to
a few 1e-3 relative, not bitwise. Prints max |diff| relative to the output's scale, per sequence length.
"""
from __future__ import annotations

import torch

from megacpp.model.mamba3 import Mamba3
from megacpp.model.mamba3_convert import config_from_mamba_ssm, from_mamba_ssm


def main() -> None:
    from mamba_ssm.modules.mamba3 import Mamba3 as PeerMamba3

    torch.manual_seed(0)
    dev = torch.device("cuda")
    kwargs = {"d_state": 64, "expand": 2, "headdim": 64, "ngroups": 1, "rope_fraction": 0.5, "chunk_size": 64}
    d_model = 512
    peer = PeerMamba3(d_model=d_model, **kwargs, device=dev)
    with torch.no_grad():
        for p in peer.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    ours = Mamba3(d_model, config_from_mamba_ssm(kwargs), layer_idx=0).to(dev)
    ours.load_state_dict(from_mamba_ssm(peer.state_dict()), strict=True)
    print(f"{'seq':>6}{'max |diff|':>14}{'output rms':>14}{'relative':>12}")
    with torch.no_grad():
        for t in (64, 200, 1024):
            x = torch.randn(2, t, d_model, device=dev)
            want, got = peer(x).float(), ours(x).float()
            diff = (want - got).abs().max().item()
            scale = want.pow(2).mean().sqrt().item()
            print(f"{t:>6}{diff:>14.3e}{scale:>14.3e}{diff / scale:>12.3e}")


if __name__ == "__main__":
    main()
