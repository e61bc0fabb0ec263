"""tools.mca_steps: the hot-loop extraction, the block count, and llvm-mca's reading."""
import shutil

import pytest

from tools import mca_steps as M

_ASM = """\
_kernel:
\tpushq\t%rbp
\tvfmadd231ps\t%zmm1, %zmm2, %zmm3
.LBB0_2:
\tvmovups\t(%rax), %zmm1
\t#APP
\t#NO_APP
\tvfmadd231ps\t(%rcx), %zmm1, %zmm4
\tvfmadd231ps\t64(%rcx), %zmm1, %zmm5
\t.p2align\t4, 0x90
\tdecq\t%r9
\tjne\t.LBB0_2
.LBB0_3:
\tvaddps\t%zmm4, %zmm5, %zmm4
\tretq
"""


def test_hot_loop_takes_the_block_with_most_fmas_without_markers():
    ins, fmas = M.hot_loop(_ASM)
    assert fmas == 2
    assert ins == ["vmovups\t(%rax), %zmm1", "vfmadd231ps\t(%rcx), %zmm1, %zmm4",
                   "vfmadd231ps\t64(%rcx), %zmm1, %zmm5", "decq\t%r9", "jne\t.LBB0_2"]


def test_blocks_per_iteration_counts_lanes_by_register_width():
    # 32-weight blocks: a zmm FMA covers 16 weights, a ymm one 8
    assert M.blocks_per_iteration(["vfmadd231ps %zmm1, %zmm2, %zmm3"], 4, 32) == 2.0
    assert M.blocks_per_iteration(["vfmadd231ps %ymm1, %ymm2, %ymm3"], 4, 32) == 1.0
    assert M.blocks_per_iteration(["vfmadd231ps %zmm1, %zmm2, %zmm3"], 16, 256) == 1.0
    # the 4/5-bit types' 256-bit step: one FMA makes each weight, one sums it
    assert M.blocks_per_iteration(["vfmadd231ps %ymm1, %ymm2, %ymm3"], 16, 32, 2) == 2.0
    assert [M.fmas_per_weight(k) for k in ("Q5_0 256-bit", "Q5_0 512-bit pairs", "Q4_K")] == [2, 1, 1]


@pytest.mark.parametrize("argv, word", [(["--targets", "znver9"], "znver9"),
                                        (["--kernels", "Q9_0"], "Q9_0")])
def test_bad_names_are_one_line_errors(argv, word, capsys):
    with pytest.raises(SystemExit) as e:
        M.main(argv)
    assert e.value.code == 2
    assert word in capsys.readouterr().err


def test_missing_mca_is_one_line_error():
    with pytest.raises(SystemExit, match="not found"):
        M.find_mca("/nonexistent/llvm-mca")


def _installed_mca():
    try:
        return M.find_mca(None)
    except SystemExit:
        return None


_MCA = _installed_mca()


def test_block_shapes_come_from_the_type_table():
    assert M.block_shape("Q5_0 512-bit pairs") == (22, 32)
    assert M.block_shape("Q4_K") == (144, 256)
    assert M.block_shape("Q6_K") == (210, 256)


@pytest.mark.skipif(_MCA is None, reason="llvm-mca not installed (Debian package llvm)")
def test_mca_cycles_see_a_dependency_chain():
    """Four FMAs into one accumulator wait on each other; into four they do not: llvm-mca's
    cycles as read here must tell the two apart (by at least the chain's length, 4 FMA
    latencies against ~1 cycle of issue per FMA on znver3's two FMA pipes)."""
    chain = ["vfmadd231ps %ymm1, %ymm2, %ymm0"] * 4
    free = [f"vfmadd231ps %ymm1, %ymm2, %ymm{r}" for r in (0, 3, 4, 5)]
    c_chain, c_free = M.mca_cycles(_MCA, "znver3", chain), M.mca_cycles(_MCA, "znver3", free)
    assert c_chain >= 4 * 3 > 2 * c_free > 0, (c_chain, c_free)


@pytest.mark.skipif(_MCA is None, reason="llvm-mca not installed (Debian package llvm)")
def test_one_kernel_for_one_target_end_to_end(capsys):
    """A kernel compiled for another CPU's ISA (Sapphire Rapids' AVX-512 on any x86-64 host:
    compiling needs no such CPU) gives a row with a positive cost."""
    assert M.main(["--targets", "sapphirerapids", "--kernels", "Q4_0 512-bit pairs", "--mca", _MCA]) == 0
    row = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("Q4_0 512-bit pairs")]
    assert len(row) == 1
    instr, cycles, per_cycle = (float(v) for v in row[0].split()[-3:])
    # a 32-weight block takes at least its 2 zmm FMAs and loads; bytes / cycle is 18 / cycles
    assert instr >= 4 and cycles > 0 and abs(per_cycle - 18 / cycles) < 0.01


def test_a_failing_mca_is_one_line_error():
    """An llvm-mca that fails (here /bin/false, which prints nothing) ends the tool with one line
    naming it, not a traceback."""
    if shutil.which("false") is None:
        pytest.skip("no false(1)")
    with pytest.raises(SystemExit, match=r"error: .*false -mcpu=znver3 failed: exit status 1"):
        M.main(["--mca", shutil.which("false"), "--targets", "znver3", "--kernels", "Q4_0 256-bit"])
