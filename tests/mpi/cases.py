"""The case matrix of the greedy lossless launches (tests/mpi/test_lossless.py): every launch whose
check is "every method, at every batch size, commits AR's tokens", in one list, each a ``Case``
that builds its own Hydra overrides. The checks a case has beyond losslessness follow from its
attributes (test_lossless.py says which)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from conftest import METHODS
from dispatch_levels import levels

FLOAT32 = tuple(f"hierarchy.stages.{i}.dtype=float32" for i in range(3))


@dataclass(frozen=True, kw_only=True)
class Case:
    """One launch: ``mpirun -n ranks python -m pipespec_mpi`` with ``overrides()`` and ``env``. A
    field left None is not overridden (the config's default, which ``groups`` assumes for
    methods and batch sizes)."""

    id: str
    ranks: int
    hierarchy: str | None  # None: the default (the embedded SmolLM2 pipeline)
    max_new_tokens: int
    n_prompts: int
    methods: tuple[str, ...] | None = None  # None: run.methods' default, METHODS
    batch_sizes: tuple[int, ...] | None = None  # None: batch 1 only (no run.batch_sizes)
    transport: str | None = None
    policy: str | None = None  # decode.policy (its default: adaptive)
    kernels: Literal["auto", "portable"] = "auto"  # device.kernels (auto: the default)
    lookahead: int | None = None
    dataset: str | None = None
    warmup_prompts: int | None = None  # None: the default, one warm-up prompt per method
    extra: tuple[str, ...] = ()  # further overrides, after the others
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))  # e.g. a dispatch level
    timeout: float = 240
    tier: Literal["ci", "long"] = "ci"
    # what these prompts are known to do: every sequence runs to max_new_tokens (no EOS), and
    # PipeSpec's target accepts proposals at the largest batch size, whatever the schedule
    full_length: bool = False
    verifies: bool = False

    @property
    def all_methods(self) -> tuple[str, ...]:
        return self.methods or METHODS

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.batch_sizes or (1,)

    @property
    def groups(self) -> set[tuple[str, int]]:
        """(method, batch size) of every group of records the run writes."""
        return {(m, b) for m in self.all_methods for b in self.sizes}

    def overrides(self) -> list[str]:
        """The Hydra overrides of the launch: the one place a case becomes a command line."""

        def listed(xs: tuple) -> str:
            return "[" + ",".join(map(str, xs)) + "]"

        optional = [
            ("hierarchy", self.hierarchy),
            ("dataset", self.dataset),
            ("run.methods", self.methods and listed(self.methods)),
            ("run.batch_sizes", self.batch_sizes and listed(self.batch_sizes)),
            ("run.warmup_prompts", self.warmup_prompts),
            ("device.kernels", None if self.kernels == "auto" else self.kernels),
            ("transport.kind", self.transport),
            ("decode.lookahead", self.lookahead),
            ("decode.policy", self.policy),
        ]
        return [
            *(f"{key}={value}" for key, value in optional if value is not None),
            "run.mode=benchmark",
            f"decode.max_new_tokens={self.max_new_tokens}",
            f"dataset.n_prompts={self.n_prompts}",
            *self.extra,
        ]


def _fixed_lookahead(ranks: int, hierarchy: str, lookahead: int, transport: str, max_new: int,
                     methods: tuple[str, ...], tier: Literal["ci", "long"] = "ci") -> Case:  # fmt: skip
    """The static policy's fixed lookaheads at batch 1, three prompts (adaptive: the
    ``adaptive-*`` cases)."""
    return Case(id=f"{hierarchy}-{transport}-lookahead{lookahead}", ranks=ranks, hierarchy=hierarchy,
                methods=methods, lookahead=lookahead, transport=transport, max_new_tokens=max_new,
                n_prompts=3, policy="static", tier=tier, full_length=True,
                verifies=lookahead > 0)  # fmt: skip


_LEVELS = levels()  # name -> environment: the CPU dispatch levels this machine can run


def portable(id: str, hierarchy: str, ranks: int, timeout: float = 600, **more: object) -> Case:
    """A case on the engine's portable plug-ins: every method at batch 1 and 4, verifying."""
    return Case(
        id=id, ranks=ranks, hierarchy=hierarchy, kernels="portable", methods=METHODS, batch_sizes=(1, 4),
        warmup_prompts=0, max_new_tokens=24, n_prompts=4, verifies=True, timeout=timeout, **more,
    )  # fmt: skip


CASES: list[Case] = [
    _fixed_lookahead(3, "tiny", 0, "mpi", 64, ("ar", "pipespec"), tier="long"),  # CI: tiny2-gloo-lookahead0
    _fixed_lookahead(3, "tiny", 1, "mpi", 40, METHODS),
    _fixed_lookahead(3, "tiny", 4, "gloo", 64, METHODS),
    _fixed_lookahead(3, "tiny", 8, "mpi", 100, METHODS, tier="long"),  # CI keeps lookaheads 1, 4, 2
    _fixed_lookahead(2, "tiny2", 0, "gloo", 48, ("ar", "pipespec")),
    _fixed_lookahead(2, "tiny2", 4, "mpi", 33, METHODS),
    _fixed_lookahead(4, "tiny4", 2, "mpi", 48, METHODS),
    # stage 0: the model-free suffix drafter
    _fixed_lookahead(3, "tiny_suffix", 0, "mpi", 48, METHODS, tier="long"),
    _fixed_lookahead(3, "tiny_suffix", 2, "gloo", 40, METHODS),
    # batched decoding (decode.batch_size, run.batch_sizes): every batch size equals AR at batch 1
    *(
        Case(
            id=f"batched-{h}",
            ranks=3,
            hierarchy=h,
            batch_sizes=(1, 2, 4),
            lookahead=1,
            max_new_tokens=24,
            n_prompts=6,
            policy="static",
            extra=("tuning=cpu_few_cores",),
            full_length=True,
            verifies=True,
        )
        for h in ("tiny", "tiny_suffix")
    ),
    # the default hierarchy (lookup -> int8 copy -> SmolLM2): batched rows are bitwise their own
    # forward, so batch 3 equals batch 1 exactly
    Case(
        id="batched-default-hierarchy",
        ranks=3,
        hierarchy=None,
        batch_sizes=(1, 3),
        warmup_prompts=0,
        max_new_tokens=20,
        n_prompts=3,
        timeout=600,
        tier="long",
    ),
    # the engine with its portable plug-ins (torch's linears, SDPA over the slots' grid)
    *(portable(f"portable-{h}", h, r) for h, r in (("tiny", 3), ("smollm2_suffix", 2))),
    # device.compile as a job runs it: each model stage's graphs made at load (the warm-up), then
    # every method at batch 1 and 4 on the compiled forward (long: inductor compiles for minutes)
    portable("compiled-tiny", "tiny", 3, extra=("device.compile=true",), timeout=900, tier="long"),
    # NCCL's rules (comm/strict.py): batched slots share one link per pair (comm/mux.py)
    *(
        Case(
            id=f"strict-b{b}",
            ranks=3,
            hierarchy="tiny",
            transport="strict",
            methods=METHODS,
            batch_sizes=(b,),
            max_new_tokens=24,
            n_prompts=6,
            verifies=True,
        )
        for b in (1, 4)
    ),
    # every CPU dispatch level this machine can run (tests/dispatch_levels.py): the tiny hierarchy
    # in float32 (the CPU kernels' path), and SmolLM2 behind the suffix drafter
    *(
        Case(
            id=f"dispatch-{level}-tiny-float32",
            ranks=3,
            hierarchy="tiny",
            methods=METHODS,
            batch_sizes=(1, 4),
            max_new_tokens=24,
            n_prompts=4,
            extra=FLOAT32,
            env=MappingProxyType(env),
        )
        for level, env in _LEVELS.items()
    ),
    *(
        Case(
            id=f"dispatch-{level}-smollm2_suffix",
            ranks=2,
            hierarchy="smollm2_suffix",
            dataset="humaneval",
            methods=METHODS,
            warmup_prompts=0,
            max_new_tokens=32,
            n_prompts=2,
            extra=("dataset.seed=7",),
            env=MappingProxyType(env),
            timeout=600,
            tier="ci" if level == "avx2" else "long",  # avx2: where the CPU has AVX-512
        )
        for level, env in _LEVELS.items()
    ),
    # the embedded real model on real prompts (its AR also equals transformers' greedy generate)
    *(
        Case(
            id=f"smollm2-{d}",
            ranks=3,
            hierarchy="smollm2",
            dataset=d,
            methods=("ar", "pipespec"),
            warmup_prompts=0,
            max_new_tokens=24,
            n_prompts=2,
            timeout=600,
            tier=t,
        )
        for d, t in (("humaneval", "ci"), ("news", "long"))
    ),
    # decode.policy=adaptive: what the stages decide follows their timings, what they commit never
    *(
        Case(
            id=f"adaptive-{h}",
            ranks=3,
            hierarchy=h,
            batch_sizes=(1, 4),
            policy="adaptive",
            max_new_tokens=32,
            n_prompts=5,
            extra=("tuning=cpu_few_cores",),
            tier=t,
        )
        for h, t in (("tiny", "ci"), ("tiny_suffix", "long"))
    ),
]
