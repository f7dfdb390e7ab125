"""benchmarks/kernel_ptx.py: the CE kernel compiled for sm_90 on a machine without a GPU, and the PTX comparison
that tells a no-op refactor from a change. Each run is a process of its own: the CPU tests import Triton under
its interpreter, and compiling for the GPU needs Triton's own library compiled, not interpreted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import kernel_ptx

pytest.importorskip("triton.backends.nvidia.compiler", reason="triton without its NVIDIA backend")

#: One launch (the GPT-2 path: padded rows, loss + gradient) at a small tile, so that each run compiles little.
ONE = ["--layout", "padded", "--case", "loss + grad", "--tiles", "1024:4"]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(kernel_ptx.REPO / "benchmarks" / "kernel_ptx.py"), *args],
                          capture_output=True, text=True, env=env, cwd=kernel_ptx.REPO, timeout=300)


def _copy(tmp_path, edit=None):
    """A copy of the working kernel elsewhere, ``edit`` = (old, new) applied."""
    copy = tmp_path / "other_ce_chunk.py"
    text = (kernel_ptx.REPO / kernel_ptx.KERNEL).read_text()
    if edit is not None:
        assert edit[0] in text
        text = text.replace(*edit)
    copy.write_text(text)
    return copy


def test_a_comment_elsewhere_gives_the_same_ptx_and_a_table(tmp_path):
    # A comment in the kernel's body: its source (Triton's cache key) and its lines change, its code does not.
    # The file's name and its lines (the debug sections) must not count.
    commented = _copy(tmp_path, edit=("    row = tl.program_id(0).to(tl.int64)\n",
                                      "    # one program per row\n    row = tl.program_id(0).to(tl.int64)\n"))
    done = _run(*ONE, "--against", str(commented), "--out", str(tmp_path), "--tag", "t")
    assert done.returncode == 0, done.stderr
    (row,) = json.loads((tmp_path / "kernel_ptx_sm90_t.json").read_text())["rows"]
    assert row["same_ptx"] is True
    assert row["tile"] == "1024:4" and 16 <= row["registers"] <= 255 and row["spill_bytes"] >= 0
    table = (tmp_path / "kernel_ptx_sm90_t.md").read_text()
    assert "| padded | loss + grad | 1024:4 |" in table and "| same |" in table


def test_a_changed_kernel_is_reported_and_fails_the_run(tmp_path):
    # the gradient's probability term scaled: a change on the launched path
    changed = _copy(tmp_path, edit=("g = coef * (tl.exp(z - shift) * inv_sum)",
                                    "g = coef * (tl.exp(z - shift) * inv_sum * 0.5)"))
    done = _run(*ONE, "--against", str(changed))
    assert done.returncode == 1, done.stderr
    assert "| DIFFERENT |" in done.stdout


def test_an_unknown_revision_is_named(tmp_path):
    done = _run(*ONE, "--against", "no-such-revision")
    assert done.returncode != 0 and "--against 'no-such-revision'" in done.stderr


def test_under_the_interpreter_it_says_to_run_without_it(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SystemExit, match="without TRITON_INTERPRET=1"):
        kernel_ptx.main(ONE)


def _kernel_parameters() -> tuple[list[str], list[str]]:
    """(constexpr flags but the tile's sizes, BLOCK_V and LANES; runtime arguments) of ce_chunk_kernel, read from
    its source."""
    source = (kernel_ptx.REPO / kernel_ptx.KERNEL).read_text()
    signature = source[source.index("def ce_chunk_kernel("):source.index("):", source.index("def ce_chunk_kernel("))]
    names = [line.strip().rstrip(",") for line in signature.splitlines()[1:] if line.strip()]
    flags = [n.split(":")[0] for n in names if "tl.constexpr" in n and not n.startswith(("BLOCK_V", "LANES"))]
    return flags, [n for n in names if ":" not in n]


def test_every_flag_of_a_launch_is_a_kernel_constexpr():
    flags, _arguments = _kernel_parameters()
    assert len(flags) > 10
    for _layout, _case, launch in kernel_ptx.launches(flags):
        assert set(launch) == set(flags)
    for given in (*(f for f, _ints in kernel_ptx.LAYOUTS.values()), *kernel_ptx.CASES.values()):
        assert set(given) <= set(flags)  # a renamed flag would otherwise be compiled as an int argument


def test_every_runtime_argument_has_a_type_or_a_value():
    # A new argument of the kernel must be typed here (pointer, float) or given a representative value (int)
    _flags, arguments = _kernel_parameters()
    assert len(arguments) > 20
    for layout in kernel_ptx.LAYOUTS:
        ints = kernel_ptx.int_arguments(layout, 4096)
        typed = {*kernel_ptx.POINTERS, *kernel_ptx.FLOATS, *ints}
        untyped = [a for a in arguments if a not in typed]
        assert not untyped, untyped
    assert kernel_ptx.int_arguments("padded", 4096)["vocab_full"] == 49152  # 50257 less its partial block


def test_bad_tiles_are_a_usage_error():
    with pytest.raises(SystemExit):
        kernel_ptx.main(["--tiles", "4096"])


def test_parameters_are_compared_by_name_not_position():
    # A kernel that gains an argument its launch leaves unused: the parameters after it are renumbered in the PTX,
    # the code is the same once each is read by its argument's name (and the declarations are left out).
    old = (".entry k(\n\t.param .u64 k_param_0,\n\t.param .u64 k_param_1\n)\n"
           "\tld.param.u64 %rd1, [k_param_0];\n\tld.param.u64 %rd2, [k_param_1];")
    new = (".entry k(\n\t.param .u64 k_param_0,\n\t.param .u64 k_param_1,\n\t.param .u64 k_param_2\n)\n"
           "\tld.param.u64 %rd1, [k_param_0];\n\tld.param.u64 %rd2, [k_param_2];")
    assert (kernel_ptx._by_parameter_name(old, ["logits_ptr", "loss_ptr"])
            == kernel_ptx._by_parameter_name(new, ["logits_ptr", "top_ptr", "loss_ptr"]))
    assert "[scratch_0]" in kernel_ptx._by_parameter_name(old, ["logits_ptr"])  # Triton's own, past the arguments
    moved = new.replace("[k_param_2]", "[k_param_1]")  # reads another argument: a change
    assert (kernel_ptx._by_parameter_name(old, ["logits_ptr", "loss_ptr"])
            != kernel_ptx._by_parameter_name(moved, ["logits_ptr", "top_ptr", "loss_ptr"]))
