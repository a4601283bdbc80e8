"""The arch family a GPU is tuned and priced as, shared by the kernels' configurations
(partition_mixing) and the cost model (cost) without either importing the other."""


def family_of(capability: tuple[int, int]) -> int:
    """The arch family a GPU of `capability` is priced and tuned as: 90, 80 or 70 (below sm_80:
    Triton's dots on FMAs)."""
    return 90 if capability[0] >= 9 else 80 if capability[0] >= 8 else 70


def delta_inside(family: int | None) -> bool:
    """Whether the mixing backward's dZ kernel makes δ itself (no `delta_kernel` launch; X̄ and
    dX̄ read once less): on sm_90 and the FMA family (sm_70), whose dZ configurations take the
    prologue without spilling under Triton 3.6 and 3.9 (tools/bench/kernel_report.py; on sm_90
    in the registers the kernel used without it); sm_80's spilled with it under Triton 3.6.
    `family` None: the interpreter's, as on sm_80 (the tests take both paths)."""
    return family in (70, 90)


def z_inside(family: int | None) -> bool:
    """Whether the hybrid's row statistics kernel makes Z = Q Xᵀ/√d itself (its tiles on chip
    over d, z + b written once: no cuBLAS GEMM, Z not read back): from sm_80, where Triton's dots
    run on tensor cores; below it (sm_70's FMAs) cuBLAS makes Z. `family` None: the
    interpreter's, as sm_80+ (the tests take both paths)."""
    return family != 70
