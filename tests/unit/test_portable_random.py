"""The generated tiny models and demo adapters are the same bits on every CPU (issue 34).

``torch.randn`` on a CPU is not: its Box-Muller takes log/cos from Sleef on the AVX2/AVX-512 path and
from libm on the scalar one (``ATEN_CPU_CAPABILITY=default``, which an ARM or an old x86 machine gets),
and the two differ in the last bit. So the committed trained demo adapters (stamped with the tiny model's
fingerprint) were left out on such machines. Every generated weight now comes from
:func:`vlora.lora.demo.portable_randn`: integer draws, exact arithmetic, one IEEE rounding.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from fractions import Fraction

import pytest
import torch

from vlora.lora.demo import portable_randn, seeded_randn


def _f32(x: float) -> float:
    """``x`` rounded to float32 (correctly rounded by the C cast in struct), back as a Python float."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def test_values_are_exact_integer_arithmetic():
    """The same values as a pure-Python computation from the same integer draws (no torch float math):
    (sum of 12 draws k_i + 6 - 6 * 2^24) / 2^24 is exact in float64, then one multiply by std and one
    rounding to float32."""
    for std in (1.0, 0.02, 1 / 3**0.5):
        got = portable_randn((7, 9), torch.Generator().manual_seed(11), std=std)
        ints = torch.randint(0, 1 << 24, (63, 12), generator=torch.Generator().manual_seed(11), dtype=torch.int64)
        want = []
        for row in ints.tolist():
            z = Fraction(sum(row) + 6 - 6 * (1 << 24), 1 << 24)
            assert float(z) == z  # exact in float64
            want.append(_f32(float(z) * std if std != 1.0 else float(z)))
        assert got.dtype == torch.float32 and got.shape == (7, 9)
        assert got.flatten().tolist() == want


def test_known_values():
    """Golden bits: any machine, any ISA, any thread count gets exactly these (big-endian float32 hex)."""
    x = seeded_randn("vlora", (6,))
    assert [struct.pack(">f", v).hex() for v in x.tolist()] == [
        "be7a53a0", "bd3de810", "40049528", "c012a73e", "bde548c8", "bf9d9e6c"]


def test_distribution_is_about_standard_normal():
    x = seeded_randn("distribution", (400_000,)).double()
    assert abs(x.mean().item()) < 0.01 and abs(x.std().item() - 1) < 0.01
    assert x.abs().max().item() <= 6  # Irwin-Hall: bounded to [-6, 6)
    for t, p in ((1, 0.3173), (2, 0.0455), (3, 0.0027)):  # two-sided normal tails, within a few tenths
        assert abs((x.abs() > t).double().mean().item() - p) < 0.3 * p + 1e-3, t
    assert torch.equal(seeded_randn("distribution", (400_000,)), x.float())  # deterministic
    assert not torch.equal(seeded_randn("other", (1000,)), x[:1000].float())
    scaled = seeded_randn("std", (1000,), std=0.02).double()
    assert torch.allclose(scaled, seeded_randn("std", (1000,)).double() * 0.02, rtol=1e-6, atol=0)


_GENERATE = r"""
import json, sys, tempfile
from pathlib import Path
import torch
from vlora.lora.demo import ensure_demo_adapters, model_fingerprint
from vlora.models.tiny import ensure_tiny_model
from vlora.models.tiny_qwen import ensure_tiny_qwen

root = Path(sys.argv[1])
llava = ensure_tiny_model(root)
qwen = ensure_tiny_qwen(root, "qwen2_vl")
demo = ensure_demo_adapters(llava, root / "demo", trained=False)
print(json.dumps({
    "capability": torch.backends.cpu.get_cpu_capability(),
    "llava": model_fingerprint(llava),
    "qwen2_vl": model_fingerprint(qwen),
    "demo_adapters": {p.name: (p / "adapter_model.safetensors").read_bytes().hex() for p in sorted(demo.iterdir())},
}))
"""


def _capabilities() -> list[str]:
    """ATEN_CPU_CAPABILITY values to try: the scalar path, AVX2 where the CPU has AVX2 or AVX-512, and the
    machine's own (unset)."""
    highest = torch.backends.cpu.get_cpu_capability()
    caps = ["default"]
    if highest in ("AVX2", "AVX512"):
        caps.append("avx2")
    caps.append("")  # unset: the highest the CPU supports
    return caps


@pytest.mark.slow
def test_generation_is_the_same_bits_under_every_cpu_capability(tmp_path):
    """The tiny LLaVA, the tiny Qwen2-VL and the demo adapters, generated in a process per
    ATEN_CPU_CAPABILITY (the scalar path, AVX2, the machine's highest), are byte for byte the same; the
    LLaVA one is the model the committed trained demo adapters were trained on."""
    from vlora.fusion.demo import TRAINED_DEMOS
    from vlora.lora.demo import COMMITTED_DIR, STAMP_FILE

    results = {}
    for cap in _capabilities():
        env = dict(os.environ)
        env.pop("ATEN_CPU_CAPABILITY", None)
        if cap:
            env["ATEN_CPU_CAPABILITY"] = cap
        done = subprocess.run([sys.executable, "-c", _GENERATE, str(tmp_path / (cap or "native"))], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        out = json.loads(done.stdout.strip().splitlines()[-1])
        if cap:
            assert out["capability"] == cap.upper(), (cap, out["capability"])  # the setting took effect
        results[cap or f"native ({out.pop('capability')})"] = out
        out.pop("capability", None)
    first, *others = results.values()
    for name, out in results.items():
        assert out == first, f"{name} generated other bytes than {next(iter(results))}"
    for spec in TRAINED_DEMOS:
        stamp = json.loads((COMMITTED_DIR / spec.name / STAMP_FILE).read_text())
        assert stamp["model"] == first["llava"], spec.name
