"""MKL's reproducibility mode on non-Intel x86 CPUs (specdec/cpu_blas.py): when importing
specdec sets it, when it leaves the user's choice alone, and that it reaches cost profiles."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from specdec.cost.table import CostTable, device_identity
from specdec.cpu_blas import AUTO_VALUE, MKL_VARIABLE, OVERRIDE_VARIABLE, configure_mkl, cpu_vendor, mkl_mode


@pytest.mark.parametrize(
    ("environ", "vendor", "expected"),
    [
        ({}, "AuthenticAMD", AUTO_VALUE),  # AMD: the fast small-product path
        ({}, "HygonGenuine", AUTO_VALUE),
        ({}, "GenuineIntel", None),  # Intel: MKL's default is tuned for it
        ({}, None, None),  # not x86 (no MKL) or unknown
        ({MKL_VARIABLE: "COMPATIBLE"}, "AuthenticAMD", "COMPATIBLE"),  # the user's own value stays
        ({OVERRIDE_VARIABLE: "off"}, "AuthenticAMD", None),  # opted out
        ({OVERRIDE_VARIABLE: "OFF", MKL_VARIABLE: "AVX2"}, "AuthenticAMD", "AVX2"),
        ({OVERRIDE_VARIABLE: "AVX2"}, "GenuineIntel", "AVX2"),  # an explicit value applies on any CPU
    ],
)
def test_configure_mkl(environ, vendor, expected):
    env = dict(environ)
    configure_mkl(env, vendor=vendor)
    assert env.get(MKL_VARIABLE) == expected
    assert mkl_mode(env) == (expected or "default")


def test_cpu_vendor_is_a_vendor_id_or_none():
    vendor = cpu_vendor()
    assert vendor is None or (vendor.isalnum() and len(vendor) >= 8), vendor


def test_importing_specdec_sets_the_mode_on_this_machine():
    """In a fresh process (MKL reads the variable once): MKL_CBWR after `import specdec` is what
    `configure_mkl` decides for this CPU, and the opt-out leaves it unset."""
    code = "import os, specdec; print(os.environ.get('MKL_CBWR'))"
    env = {"PATH": "/usr/bin:/bin"}
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout.strip()
    assert plain == str(AUTO_VALUE if cpu_vendor() not in (None, "GenuineIntel") else None)
    opted_out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**env, OVERRIDE_VARIABLE: "off"}, check=True)
    assert opted_out.stdout.strip() == "None"


def test_cost_profiles_record_the_mode_and_flag_another(monkeypatch):
    """A CPU cost profile measured under another MKL mode is used with a (non-blocking) note:
    the mode changes how much a few-token forward costs."""
    model = torch.nn.Linear(2, 2)
    monkeypatch.setenv(MKL_VARIABLE, AUTO_VALUE)
    here = device_identity(torch.device("cpu"))
    assert here["mkl_cbwr"] == AUTO_VALUE
    table = CostTable.synthetic(lambda b, c, n: 1.0, lambda b, c, n: 0.1)
    table.meta["device"] = {**here, "mkl_cbwr": "default"}
    diffs = [d for d in table.differences(model, None) if d.field == "MKL_CBWR"]
    assert len(diffs) == 1 and not diffs[0].blocking and diffs[0].profile == "default" and diffs[0].here == AUTO_VALUE
    table.meta["device"] = here
    assert not [d for d in table.differences(model, None) if d.field == "MKL_CBWR"]
