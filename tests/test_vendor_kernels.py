"""Which kernels give the same bytes on Intel and AMD CPUs (issue 45; README, "Determinism").

tests/xcpu/fingerprint.py hashes the output of every kind of kernel the stages use, under the
project's CPU pins, in a fresh interpreter (the pins are applied before numpy and torch load).
Against the reference made on the same vendor's CPU every op must match; against the other
vendor's, the ops that differ must be exactly the ones the README names as following the CPU
vendor (VENDOR_DEPENDENT). A kernel that starts to differ, or one that stops differing (a fix,
a new torch), fails here, so the README's contract and the machine agree.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import project_env

ROOT = Path(__file__).resolve().parents[1]
XCPU = ROOT / "tests" / "xcpu"
REFERENCES = {"GenuineIntel": XCPU / "intel-xeon-avx512.json", "AuthenticAMD": XCPU / "amd-epyc.json"}
# torch's float sqrt (and with it AdamW's step, which divides by sqrt of its second moment) goes
# through MKL's vector math (vsSqrt / vdSqrt), which is not correctly rounded (about 17 % of
# float32 results an ulp off here) and rounds differently on Intel and AMD even under
# MKL_CBWR=COMPATIBLE. Every other kernel of the fingerprint gives the same bytes on both.
VENDOR_DEPENDENT = {"unary_sqrt", "adamw_5_steps"}


def vendor() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return "unknown"


@pytest.fixture(scope="module")
def mine() -> dict[str, str]:
    """This machine's fingerprint, from a fresh interpreter as a stage runs."""
    proc = subprocess.run([sys.executable, str(XCPU / "fingerprint.py")], cwd=ROOT, env={**project_env(), "PYTHONPATH": str(ROOT)},
                          text=True, capture_output=True, timeout=600, check=True)
    return json.loads(proc.stdout)["ops"]


def differing(mine: dict[str, str], reference: Path) -> set[str]:
    ref = json.loads(reference.read_text())["ops"]
    assert set(ref) == set(mine), f"{reference.name} fingerprints other ops: {sorted(set(ref) ^ set(mine))}"
    return {op for op in ref if ref[op] != mine[op]}


def test_every_kernel_gives_the_bytes_of_its_vendors_reference(mine):
    here = vendor()
    if here not in REFERENCES:
        pytest.skip(f"no reference fingerprint for a {here} CPU (tests/xcpu/ has {sorted(REFERENCES)})")
    assert differing(mine, REFERENCES[here]) == set(), f"on this {here} CPU"


def test_across_vendors_exactly_the_documented_kernels_differ(mine):
    here = vendor()
    others = [path for name, path in REFERENCES.items() if name != here]
    assert others
    for reference in others:
        assert differing(mine, reference) == VENDOR_DEPENDENT, reference.name


def test_the_readme_names_the_vendor_dependent_kernels():
    text = (ROOT / "README.md").read_text()
    determinism = text.split("### Determinism", 1)[1].split("\n### ", 1)[0]
    assert "tests/test_vendor_kernels.py" in determinism
    assert "sqrt" in determinism and "AdamW" in determinism
    assert "Same bytes on any x86-64 CPU" not in text
