"""Built-in synthetic arithmetic word problems: the default dataset, no download needed.

Each problem is a short story (apples, coins, a train's passengers, ...) that starts from a
quantity and changes it a few times by adding, taking away, multiplying or splitting. The
solution walks through every step in GSM8K style and ends with ``#### <answer>``. Every
intermediate quantity is a whole number between 1 and ``max_value``, so the story never
asks anyone to eat more apples than they have.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from specroll.config_checks import check_int, check_seed, require
from specroll.data.problems import Problem

OPERATIONS: tuple[str, ...] = ("+", "-", "*", "/")

# How often a problem that ran out of valid moves is redrawn before giving up; only configs
# that make valid problems vanishingly rare (e.g. division only, tiny operands) get there.
_MAX_ATTEMPTS = 1000


@dataclass(frozen=True)
class SyntheticConfig:
    """Size and difficulty of the synthetic dataset.

    Attributes:
        num_problems: number of problems to generate.
        min_steps: fewest operations applied to the starting quantity.
        max_steps: most operations applied to the starting quantity.
        max_operand: largest starting quantity and largest amount added or taken away.
        max_factor: largest multiplier or number of equal parts for ``*`` and ``/``.
        max_value: bound on every intermediate quantity and on the answer.
        operations: the operations stories may use, a subset of ``("+", "-", "*", "/")``.
        seed: seed of the generator; the same config always yields the same problems.
    """

    num_problems: int = 1000
    min_steps: int = 2
    max_steps: int = 4
    max_operand: int = 50
    max_factor: int = 5
    max_value: int = 1000
    operations: tuple[str, ...] = ("+", "-", "*")
    seed: int = 0

    def __post_init__(self) -> None:
        # Hydra hands over lists; a tuple keeps the frozen config hashable.
        object.__setattr__(self, "operations", tuple(self.operations))
        check_int("num_problems", self.num_problems, 1)
        check_int("min_steps", self.min_steps, 1)
        check_int("max_steps", self.max_steps, self.min_steps)
        check_int("max_operand", self.max_operand, 2)
        check_int("max_factor", self.max_factor, 2)
        check_int("max_value", self.max_value, self.max_operand)
        check_seed("seed", self.seed)
        require(bool(self.operations) and all(op in OPERATIONS for op in self.operations), "operations",
                self.operations, f"a non-empty subset of {OPERATIONS}")


@dataclass(frozen=True)
class _Theme:
    """One story setting; templates take ``{name}`` and ``{n}`` (an amount or a factor)."""

    item: str
    start: str
    steps: dict[str, tuple[str, ...]]
    question: str


_THEMES: tuple[_Theme, ...] = (
    _Theme(
        item="apples",
        start="{name} picks {n} apples at the orchard.",
        steps={
            "+": (
                "Then {name} picks {n} more apples.",
                "A neighbour gives {name} {n} apples.",
                "{name} buys {n} apples at the market.",
            ),
            "-": (
                "{name} eats {n} of the apples.",
                "{name} gives {n} apples to a friend.",
                "{name} bakes a pie with {n} of the apples.",
            ),
            "*": (
                "{name}'s aunt brings a crate, and now {name} has {n} times as many apples.",
                "After a second harvest, {name} has {n} times as many apples as before.",
            ),
            "/": (
                "{name} sorts the apples into {n} equal bags and keeps only one bag.",
                "{name} shares the apples equally among {n} children and keeps one share.",
            ),
        },
        question="How many apples does {name} have now?",
    ),
    _Theme(
        item="coins",
        start="{name} has {n} coins in a piggy bank.",
        steps={
            "+": (
                "{name} finds {n} more coins under the sofa.",
                "{name} earns {n} coins for doing chores.",
                "A grandparent gives {name} {n} coins.",
            ),
            "-": (
                "{name} spends {n} coins on a snack.",
                "{name} lends {n} coins to a cousin.",
                "{name} pays {n} coins for a comic book.",
            ),
            "*": (
                "On {name}'s birthday the savings grow to {n} times as many coins.",
                "A saving challenge leaves {name} with {n} times as many coins as before.",
            ),
            "/": (
                "{name} splits the coins equally into {n} jars and keeps one jar.",
                "{name} shares the coins equally among {n} siblings and keeps one share.",
            ),
        },
        question="How many coins does {name} have now?",
    ),
    _Theme(
        item="blank pages",
        start="{name}'s notebook has {n} blank pages.",
        steps={
            "+": (
                "{name} glues in {n} extra blank pages.",
                "A teacher gives {name} {n} more blank pages to add.",
            ),
            "-": (
                "{name} fills {n} pages with homework.",
                "{name} uses {n} pages to draw maps.",
                "{name} writes a story on {n} of the pages.",
            ),
            "*": (
                "{name} switches to a notebook with {n} times as many blank pages.",
                "{name} swaps it for a thicker pad that has {n} times as many blank pages.",
            ),
            "/": (
                "{name} splits the blank pages into {n} equal stacks and keeps one stack.",
                "{name} shares the blank pages equally with classmates, {n} shares in all, "
                "and keeps one share.",
            ),
        },
        question="How many blank pages does {name} have now?",
    ),
    _Theme(
        item="passengers",
        start="A train leaves the first station with {n} passengers.",
        steps={
            "+": (
                "At the next stop, {n} passengers get on.",
                "At a busy station, {n} more passengers board.",
            ),
            "-": (
                "At the next stop, {n} passengers get off.",
                "At a small town, {n} passengers leave the train.",
            ),
            "*": (
                "At the city hub so many people board that there are {n} times as many "
                "passengers.",
                "During rush hour the number of passengers becomes {n} times as large.",
            ),
            "/": (
                "The train splits into {n} parts with equal numbers of passengers, and one part "
                "goes on.",
                "The passengers are spread equally over {n} trains, and we follow one of them.",
            ),
        },
        question="How many passengers are on the train now?",
    ),
    _Theme(
        item="cookies",
        start="{name} bakes {n} cookies.",
        steps={
            "+": (
                "{name} bakes another batch of {n} cookies.",
                "A friend brings {name} {n} more cookies.",
            ),
            "-": (
                "{name}'s friends eat {n} of the cookies.",
                "{name} sells {n} cookies at a bake sale.",
                "{name} drops {n} cookies on the floor.",
            ),
            "*": (
                "{name} follows a bigger recipe and ends up with {n} times as many cookies.",
                "{name} bakes all afternoon and now has {n} times as many cookies.",
            ),
            "/": (
                "{name} packs the cookies equally into {n} boxes and keeps one box.",
                "{name} shares the cookies equally among {n} friends, {name} included, and "
                "keeps one share.",
            ),
        },
        question="How many cookies does {name} have now?",
    ),
    _Theme(
        item="marbles",
        start="{name} has {n} marbles.",
        steps={
            "+": (
                "{name} wins {n} marbles in a game.",
                "{name} finds {n} marbles in the garden.",
            ),
            "-": (
                "{name} loses {n} marbles through a hole in a pocket.",
                "{name} trades away {n} marbles for a sticker.",
            ),
            "*": (
                "After a lucky trade, {name} has {n} times as many marbles.",
                "{name}'s collection grows to {n} times its size over the summer.",
            ),
            "/": (
                "{name} divides the marbles into {n} equal pouches and keeps one pouch.",
                "{name} splits the marbles equally among {n} teams and keeps one team's share.",
            ),
        },
        question="How many marbles does {name} have now?",
    ),
    _Theme(
        item="books",
        start="A library shelf holds {n} books.",
        steps={
            "+": (
                "The librarian adds {n} new books to the shelf.",
                "Readers return {n} books to the shelf.",
            ),
            "-": (
                "Readers borrow {n} books from the shelf.",
                "The librarian removes {n} worn-out books.",
            ),
            "*": (
                "After a donation, the shelf holds {n} times as many books.",
                "The shelf is replaced by a bigger one holding {n} times as many books.",
            ),
            "/": (
                "The books are spread equally over {n} shelves, and only the first stays here.",
                "The librarian splits the books equally into {n} crates and leaves one crate "
                "on the shelf.",
            ),
        },
        question="How many books are on the shelf now?",
    ),
)

_NAMES: tuple[str, ...] = (
    "Ava", "Ben", "Carla", "Dev", "Elena", "Farid", "Grace", "Hiro",
    "Ines", "Jamal", "Kofi", "Lena", "Mateo", "Nora", "Omar", "Priya",
)

_SOLUTION_STEPS: dict[str, str] = {
    "+": "Adding {n} gives {a} + {n} = {b} {item}.",
    "-": "Taking away {n} leaves {a} - {n} = {b} {item}.",
    "*": "{n} times as many is {a} * {n} = {b} {item}.",
    "/": "One of {n} equal parts is {a} / {n} = {b} {item}.",
}


def _amount_choices(op: str, value: int, cfg: SyntheticConfig) -> range | list[int]:
    """Amounts ``op`` may apply to ``value`` keeping the result a whole number in [1, max_value]."""
    if op == "+":
        return range(1, min(cfg.max_operand, cfg.max_value - value) + 1)
    if op == "-":
        return range(1, min(cfg.max_operand, value - 1) + 1)
    if op == "*":
        return range(2, min(cfg.max_factor, cfg.max_value // value) + 1)
    return [parts for parts in range(2, cfg.max_factor + 1) if value % parts == 0]


def _apply(op: str, value: int, amount: int) -> int:
    """The quantity after applying ``op`` with ``amount``; division is exact by construction."""
    if op == "+":
        return value + amount
    if op == "-":
        return value - amount
    if op == "*":
        return value * amount
    return value // amount


def _draw_problem(rng: random.Random, cfg: SyntheticConfig) -> Problem | None:
    """One random story, or None when it reached a quantity no allowed operation can change."""
    theme, name = rng.choice(_THEMES), rng.choice(_NAMES)
    value = rng.randint(2, cfg.max_operand)
    story = [theme.start.format(name=name, n=value)]
    solution = [f"At the start there are {value} {theme.item}."]
    for _ in range(rng.randint(cfg.min_steps, cfg.max_steps)):
        moves = [op for op in cfg.operations if _amount_choices(op, value, cfg)]
        if not moves:
            return None
        op = rng.choice(moves)
        amount = rng.choice(_amount_choices(op, value, cfg))
        result = _apply(op, value, amount)
        story.append(rng.choice(theme.steps[op]).format(name=name, n=amount))
        solution.append(_SOLUTION_STEPS[op].format(n=amount, a=value, b=result, item=theme.item))
        value = result
    story.append(theme.question.format(name=name))
    solution.append(f"#### {value}")
    return Problem(question=" ".join(story), answer=str(value), solution="\n".join(solution))


def generate_synthetic(cfg: SyntheticConfig) -> list[Problem]:
    """Generate ``cfg.num_problems`` problems, identical for identical configs.

    Problems are drawn one after another from ``random.Random(cfg.seed)``, so a smaller
    ``num_problems`` yields a prefix of a larger one.
    """
    rng = random.Random(cfg.seed)
    problems = []
    for _ in range(cfg.num_problems):
        for _ in range(_MAX_ATTEMPTS):
            problem = _draw_problem(rng, cfg)
            if problem is not None:
                problems.append(problem)
                break
        else:
            raise ValueError(
                f"SyntheticConfig.operations={cfg.operations} cannot make {cfg.min_steps}-"
                f"{cfg.max_steps} step problems within max_operand={cfg.max_operand}, "
                f"max_factor={cfg.max_factor}, max_value={cfg.max_value}; allow '+' and '-' "
                "or raise the bounds"
            )
    return problems
