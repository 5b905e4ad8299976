"""Stage specifications: which consecutive layers each pipeline stage owns.

A spec is written `0-6,7-13,14-21` (inclusive ranges, in order, covering every
layer exactly once). `balanced_split` makes one from a stage count.
"""

from dataclasses import dataclass

from zl_base.errors import ZLError


@dataclass(frozen=True)
class StageRange:
    """Layers `first..last` (inclusive) of the model, owned by stage `index`."""

    index: int
    first: int
    last: int

    @property
    def num_layers(self) -> int:
        return self.last - self.first + 1

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"


def format_spec(stages: list[StageRange]) -> str:
    return ",".join(str(s) for s in stages)


def stages_phrase(num_stages: int) -> str:
    """`3 stages`, or `1 stage (one device)`: what a run of `num_stages` is, in a line for the user."""
    return "1 stage (the whole model on one device)" if num_stages == 1 else f"{num_stages} stages"


def balanced_split(num_layers: int, num_stages: int) -> list[StageRange]:
    """Split `num_layers` into `num_stages` consecutive ranges differing by at most one layer.

    Earlier stages get the extra layers (stage 0 also carries the embedding
    lookup, later stages nothing more, so this keeps the spread small). One
    stage is the whole model on one device: the baseline a pipeline is measured
    against.

    Raises:
        ZLError: fewer than 1 stage, or more stages than layers.
    """
    if num_stages < 1:
        raise ZLError(
            f"--num-stages {num_stages}: needs at least 1 stage (1: the whole model on one device). "
            "Use --num-stages 1 or more (the default is 3)."
        )
    if num_stages > num_layers:
        raise ZLError(
            f"--num-stages {num_stages}: the model has only {num_layers} layers, so at most "
            f"{num_layers} stages of one layer each. Use --num-stages {num_layers} or fewer."
        )
    base, extra = divmod(num_layers, num_stages)
    stages, first = [], 0
    for k in range(num_stages):
        n = base + (1 if k < extra else 0)
        stages.append(StageRange(k, first, first + n - 1))
        first += n
    return stages


def parse_spec(spec: str, num_layers: int) -> list[StageRange]:
    """Parse and validate a stage spec against a model with `num_layers` layers.

    Raises:
        ZLError: a malformed range, an empty or descending range, a gap, an
            overlap, a layer beyond the model, or incomplete coverage. The message names the range and the model's layer count.
    """
    hint = (
        f"The model has {num_layers} layers (0-{num_layers - 1}); write consecutive inclusive ranges "
        f"that cover each layer once, e.g. --stages {format_spec(balanced_split(num_layers, min(3, num_layers)))}"
        if num_layers >= 2
        else f"The model has {num_layers} layer(s)"
    )
    parts = [p.strip() for p in spec.split(",")]
    if not spec.strip() or any(not p for p in parts):
        raise ZLError(f"--stages {spec!r}: empty stage range. {hint}.")
    stages: list[StageRange] = []
    for k, part in enumerate(parts):
        bounds = part.split("-")
        try:
            if len(bounds) == 1:
                first = last = int(bounds[0])
            elif len(bounds) == 2:
                first, last = int(bounds[0]), int(bounds[1])
            else:
                raise ValueError(part)
        except ValueError:
            raise ZLError(f"--stages {spec!r}: stage {k} range {part!r} is not of the form FIRST-LAST. {hint}.") from None
        if first < 0:
            raise ZLError(f"--stages {spec!r}: stage {k} range {part!r} starts below layer 0. {hint}.")
        if last < first:
            raise ZLError(f"--stages {spec!r}: stage {k} range {part!r} is descending (empty). {hint}.")
        if last >= num_layers:
            raise ZLError(
                f"--stages {spec!r}: stage {k} range {part!r} reaches layer {last}, beyond the model's "
                f"last layer {num_layers - 1}. {hint}."
            )
        if stages:
            prev = stages[-1]
            if first <= prev.last:
                raise ZLError(
                    f"--stages {spec!r}: stage {k} range {part!r} overlaps stage {k - 1} range {prev} "
                    f"(layer {first} is in both). {hint}."
                )
            if first > prev.last + 1:
                raise ZLError(
                    f"--stages {spec!r}: gap between stage {k - 1} range {prev} and stage {k} range {part!r} "
                    f"(layers {prev.last + 1}-{first - 1} belong to no stage). {hint}."
                )
        elif first != 0:
            raise ZLError(
                f"--stages {spec!r}: the first stage starts at layer {first}, so layers 0-{first - 1} "
                f"belong to no stage. {hint}."
            )
        stages.append(StageRange(k, first, last))
    if stages[-1].last != num_layers - 1:
        raise ZLError(
            f"--stages {spec!r}: the last stage ends at layer {stages[-1].last}, so layers "
            f"{stages[-1].last + 1}-{num_layers - 1} belong to no stage. {hint}."
        )
    return stages
