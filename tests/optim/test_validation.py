"""Argument and mask validation of OnebitAdam and MomentumMask, and the dead-coordinate warning (review issue 12).

Each test names the finding it covers and says in its docstring what used to happen. The multi-rank cases run as
``Trainer.fit`` calls inside one spawned 2-rank gloo session (module-scoped fixture, as in ``test_callbacks.py``):
an error must be raised on every rank, at setup (0 training steps), and the session must end (no rank left waiting in
a collective). The model is ``tests/callback_models.py``'s ``TokenRegressor``: ``Embedding(20, 8)`` whose rows 10..19
are never looked up (their gradient is exactly zero on every rank and step), mean-pooled into ``Linear(8, 1)``.
"""

from __future__ import annotations

import copy
import re
import warnings
from typing import Any, Callable, Optional

import pytest
import torch
from torch import nn

import lightning.pytorch as pl
import lightning_onebit  # noqa: F401  (registers the strategies)
from lightning_onebit import AutoFreeze, MomentumMask, OnebitAdam, OnebitLamb, ZeroOneAdam
from lightning_onebit.optim.functional import adam_step_bound
from tests.callback_models import DIM, USED_ROWS, VOCAB, TokenRegressor, token_loader, unused_rows_mask
from tests.distributed import run_distributed, run_scenarios, scenario_results
from tests.lightning_models import trainer_kwargs

WORLD_SIZE = 2
FREEZE, STEPS = 3, 5  # steps 4 and 5 are compressed
DEAD = (VOCAB - USED_ROWS) * DIM  # 80 coordinates of emb.weight never get a gradient


# ======================================================================================== models (module level: spawn)
class OptionsRegressor(TokenRegressor):
    """``TokenRegressor`` with optimizer options: ``named`` passes ``named_parameters()``; ``head_only`` gives the
    optimizer only the head (the embedding still trains under DDP but OnebitAdam does not hold it);
    ``exp_avg_mask`` is set on the embedding; ``complex_param`` adds a complex ``phase`` used in ``forward``."""

    def __init__(
        self,
        named: bool = False,
        head_only: bool = False,
        exp_avg_mask: Optional[torch.Tensor] = None,
        complex_param: bool = False,
        **optimizer_kwargs: Any,
    ) -> None:
        super().__init__(freeze_step=FREEZE)
        self.named, self.head_only, self.exp_avg_mask = named, head_only, exp_avg_mask
        self.optimizer_kwargs = optimizer_kwargs
        self.phase = nn.Parameter(torch.ones(DIM, dtype=torch.complex64)) if complex_param else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens).mean(1)
        if self.phase is not None:
            h = (h * self.phase).real
        return self.head(torch.tanh(h))

    def configure_optimizers(self) -> Any:
        kwargs = dict(lr=self.lr, weight_decay=0.0, freeze_step=self.freeze_step, **self.optimizer_kwargs)
        if self.head_only:
            return OnebitAdam(self.head.parameters(), **kwargs)
        if self.exp_avg_mask is not None:
            rest = [p for n, p in self.named_parameters() if n != "emb.weight"]
            groups = [{"params": [self.emb.weight], "exp_avg_mask": [self.exp_avg_mask]}, {"params": rest}]
            return OnebitAdam(groups, **kwargs)
        return OnebitAdam(self.named_parameters() if self.named else self.parameters(), **kwargs)


def _fit(rank: int, world_size: int, model: OptionsRegressor, callbacks: list[pl.Callback]) -> dict[str, Any]:
    """One fit of ``STEPS`` steps; the error (if any), steps done, OnebitAdam warnings and the unused rows' trace."""
    trainer = pl.Trainer(**trainer_kwargs(world_size, STEPS, callbacks=list(callbacks)))
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, token_loader(rank, STEPS))
        except Exception as err:  # noqa: BLE001 - the type and message are what the tests check
            error = (type(err).__name__, str(err))
    onebit = trainer.strategy.onebit_optimizer
    return dict(
        error=error,
        steps=len(model.losses),
        warnings=[str(w.message) for w in caught if str(w.message).startswith("OnebitAdam")],
        # largest |weight| of the never-looked-up rows after each step, and of the used rows
        unused=[float(w[USED_ROWS:].abs().max()) for w in model.emb_trace],
        used=[float(w[:USED_ROWS].abs().max()) for w in model.emb_trace],
        finite=bool(all(torch.isfinite(p).all() for p in model.parameters())),
        # elements of the dead-coordinate masks the optimizer keeps (dead_coordinates="mask")
        kept=sum(m.numel() for m in (onebit.masks.kept or {}).values()) if onebit is not None else None,
    )


def _values_mask(value: float) -> torch.Tensor:
    """1 on the used rows except one coordinate set to ``value``; 0 on the unused rows."""
    mask = unused_rows_mask()
    mask[0, 0] = value
    return mask


# ======================================================================================== scenarios (run on each rank)
def scenario_mask_values(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    """Masks with values other than 0/1, through MomentumMask and through OnebitAdam's exp_avg_mask."""
    doubled = unused_rows_mask() * 2.0  # 2 on the used rows, 0 on the unused ones
    return dict(
        callback_nan=_fit(
            rank, world_size, OptionsRegressor(), [MomentumMask({"emb.weight": _values_mask(float("nan"))})]
        ),
        callback_two=_fit(rank, world_size, OptionsRegressor(), [MomentumMask({"emb.*": lambda p: doubled})]),
        optimizer_two=_fit(rank, world_size, OptionsRegressor(exp_avg_mask=doubled), []),
        callback_bool=_fit(
            rank, world_size, OptionsRegressor(), [MomentumMask({"emb.weight": unused_rows_mask().bool()})]
        ),
    )


def scenario_not_held(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    """MomentumMask for a parameter OnebitAdam does not hold (the optimizer gets only the head)."""
    return dict(
        explicit=_fit(
            rank, world_size, OptionsRegressor(head_only=True), [MomentumMask({"emb.weight": unused_rows_mask()})]
        ),
        auto=_fit(rank, world_size, OptionsRegressor(head_only=True), [MomentumMask(auto=True)]),
        glob=_fit(rank, world_size, OptionsRegressor(head_only=True), [MomentumMask({"*.weight": torch.ones_like})]),
    )


def scenario_complex(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    """A model with a complex parameter."""
    return dict(fit=_fit(rank, world_size, OptionsRegressor(complex_param=True), []))


def scenario_dead(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    """The defaults, named parameters, ``dead_coordinates`` "warn" and "ignore", MomentumMask(auto=True), an explicit
    mask covering half the dead rows."""
    half = torch.ones(VOCAB, DIM)
    half[USED_ROWS : USED_ROWS + 5] = 0  # covers 40 of the 80 dead coordinates
    return dict(
        default=_fit(rank, world_size, OptionsRegressor(), []),
        named=_fit(rank, world_size, OptionsRegressor(named=True), []),
        # DeepSpeed's behaviour: no mask and no cap on the update
        warn=_fit(rank, world_size, OptionsRegressor(dead_coordinates="warn", cap_update=False), []),
        off=_fit(rank, world_size, OptionsRegressor(dead_coordinates="ignore", cap_update=False), []),
        # no mask, the update capped (the default)
        warn_capped=_fit(rank, world_size, OptionsRegressor(dead_coordinates="warn"), []),
        auto=_fit(rank, world_size, OptionsRegressor(), [MomentumMask(auto=True)]),
        half=_fit(rank, world_size, OptionsRegressor(), [MomentumMask({"emb.weight": half})]),
    )


_SCENARIOS: dict[str, Callable[[int, int, str], dict[str, Any]]] = {
    "mask_values": scenario_mask_values,
    "not_held": scenario_not_held,
    "complex": scenario_complex,
    "dead": scenario_dead,
}


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    workdir = str(tmp_path_factory.mktemp("onebit_validation"))
    return run_distributed(run_scenarios, WORLD_SIZE, tuple(_SCENARIOS.items()), workdir, timeout_s=240)


def _refused_at_setup(result: dict[str, Any], error_type: str, *fragments: str) -> None:
    assert result["error"] is not None, f"expected {error_type}, the fit ran {result['steps']} steps"
    assert result["error"][0] == error_type, result["error"]
    assert result["steps"] == 0, result  # before any training step (and so before any compressed collective)
    for fragment in fragments:
        assert fragment in result["error"][1], (fragment, result["error"][1])


# ======================================================================================== finding 6: mask values
def test_mask_values_other_than_0_and_1_are_refused_at_setup_on_every_rank(session: list[dict[str, Any]]) -> None:
    """Finding 6. Used to: ``MomentumMask`` and ``exp_avg_mask`` took any value and trained on silently. One NaN in
    the embedding's mask made the used rows NaN at the first compressed step and the whole embedding NaN at the next
    (the NaN momentum poisons the compressed allreduce's scales); a mask of 2.0 multiplies the stored momentum by 2
    every compressed step, so it grows geometrically (the used rows' largest weight went 3.35 -> 4.11 in the second
    compressed step instead of 3.35 -> 3.35).
    Now: ``ValueError`` at setup on both ranks (0 steps), naming the parameter and the offending value; a bool 0/1
    mask is accepted (converted to the parameter's dtype) and trains."""
    for result in scenario_results(session, "mask_values"):
        _refused_at_setup(result["callback_nan"], "ValueError", "MomentumMask: the mask for 'emb.weight'", "nan",
                          "other than 0 and 1")
        _refused_at_setup(result["callback_two"], "ValueError", "'emb.weight'", "e.g. 2.0")
        _refused_at_setup(result["optimizer_two"], "ValueError", "exp_avg_mask[0] of param group 0", "e.g. 2.0")
        ok = result["callback_bool"]
        assert ok["error"] is None and ok["steps"] == STEPS and ok["finite"], ok
        assert max(ok["unused"]) == ok["unused"][0]  # masked rows never move (weight decay 0)


def test_mask_value_errors_in_the_optimizer_name_group_and_index() -> None:
    """Finding 6, without Lightning: the same checks in ``OnebitAdam(exp_avg_mask=...)`` and ``set_exp_avg_mask``
    (they used to accept NaN, inf, 2.0, 0.5 and integer masks)."""
    a, b = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(4, 3))
    cases = [
        (torch.full((4, 3), float("nan")), "exp_avg_mask[1] of param group 0 has 12 value(s) other than 0 and 1 (e.g. "
                                           "nan)"),
        (torch.full((4, 3), float("inf")), "other than 0 and 1 (e.g. inf)"),
        (torch.full((4, 3), 0.5), "other than 0 and 1 (e.g. 0.5)"),
        (torch.ones(4, 3, dtype=torch.long), "exp_avg_mask[1] of param group 0 has dtype torch.int64"),
        (torch.ones(3, 4), "exp_avg_mask[1] of param group 0 has shape (3, 4) but its parameter has shape (4, 3)"),
    ]
    for mask, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            OnebitAdam([{"params": [a, b], "exp_avg_mask": [None, mask]}], freeze_step=2)
    with pytest.raises(ValueError, match=re.escape("exp_avg_mask of param group 1 (group-wide, for its parameter 0)")):
        OnebitAdam([{"params": [a]}, {"params": [b], "exp_avg_mask": torch.full((4, 3), 2.0)}], freeze_step=2)
    opt = OnebitAdam([("a", a), ("b", b)], freeze_step=2)
    with pytest.raises(ValueError, match=re.escape("set_exp_avg_mask: the mask for 'b' (param group 0, index 1, shape "
                                                  "(4, 3)) has 1 value(s) other than 0 and 1 (e.g. 2.0)")):
        mask = torch.ones(4, 3)
        mask[1, 1] = 2.0
        opt.set_exp_avg_mask(b, mask)
    assert opt.param_groups[0]["exp_avg_mask"] == [None, None]  # a refused mask changes nothing
    opt.set_exp_avg_mask(b, torch.tensor([[True, False, True]] * 4))
    stored = opt.param_groups[0]["exp_avg_mask"][1]
    assert stored.dtype == torch.float32 and stored.sum() == 8


# ======================================================================================== finding 7: parameter not held
def test_momentum_mask_for_a_parameter_the_optimizer_does_not_hold(session: list[dict[str, Any]]) -> None:
    """Finding 7. Used to: ``MomentumMask({"emb.weight": ...})`` with an optimizer that holds only the head passed
    setup, trained ``freeze_step`` steps and failed at the first compressed step with "set_exp_avg_mask: the
    parameter is not managed by this optimizer" (no name); ``MomentumMask(auto=True)`` failed the same way, since it
    watched every trainable parameter. Now: the explicit mask is a ``ValueError`` at ``on_fit_start`` (0 steps) on
    both ranks naming 'emb.weight'; auto mode and a glob only consider what the optimizer holds and train through."""
    for result in scenario_results(session, "not_held"):
        _refused_at_setup(result["explicit"], "ValueError", "MomentumMask: 'emb.weight' names ['emb.weight']",
                          "does not hold")
        for name in ("auto", "glob"):
            r = result[name]
            assert r["error"] is None and r["steps"] == STEPS and r["finite"], (name, r)


def test_set_exp_avg_mask_for_a_foreign_parameter_names_its_shape() -> None:
    """Finding 7, the optimizer's own message: it used to be "the parameter is not managed by this optimizer"."""
    opt = OnebitAdam([nn.Parameter(torch.randn(3))], freeze_step=2)
    with pytest.raises(ValueError, match=re.escape("set_exp_avg_mask: the parameter of shape (20, 8) is not managed by "
                                                  "this optimizer")):
        opt.set_exp_avg_mask(nn.Parameter(torch.randn(20, 8)), torch.ones(20, 8))


# ======================================================================================== finding 8: complex / integer
def test_complex_parameter_is_refused_at_construction(session: list[dict[str, Any]]) -> None:
    """Finding 8. Used to: a model with a complex parameter trained through warmup (DDP averages complex gradients)
    and failed on both ranks at the first compressed step with "buffer must be floating point, got torch.complex64".
    Now: ``ValueError`` from ``OnebitAdam.__init__`` (configure_optimizers, 0 steps) on both ranks, naming the
    parameter, its dtype and the fix."""
    for result in scenario_results(session, "complex"):
        _refused_at_setup(result["fit"], "ValueError", "parameter 0 of param group 0 (shape (8,))",
                          "torch.complex64", "torch.view_as_real")


def test_complex_and_integer_parameters_are_refused_by_init_and_add_param_group() -> None:
    """Finding 8, without Lightning; an integer parameter can never get a gradient and is refused too. A refused
    ``add_param_group`` leaves the optimizer as it was."""
    real = nn.Parameter(torch.randn(2))
    cplx = nn.Parameter(torch.randn(2, dtype=torch.complex64))
    ints = nn.Parameter(torch.zeros(2, dtype=torch.int32), requires_grad=False)
    message = "'z' (param group 0, index 1, shape (2,)) has dtype torch.complex64"
    with pytest.raises(ValueError, match=re.escape(message)):
        OnebitAdam([("w", real), ("z", cplx)], freeze_step=2)
    opt = OnebitAdam([real], freeze_step=2)
    with pytest.raises(ValueError, match=re.escape("parameter 0 of param group 1 (shape (2,)) has dtype torch.int32")):
        opt.add_param_group({"params": [ints]})
    assert len(opt.param_groups) == 1


# ======================================================================================== finding 9: dead coordinates
def test_dead_coordinates_are_kept_at_rest_by_default_with_a_short_warning(session: list[dict[str, Any]]) -> None:
    """Finding 9, and a safe default. Used to: without a mask, the embedding rows that are never looked up jumped at
    the first compressed step (here row 10, which shares its compression chunk with live rows, went from 2.6 to about
    2.5e4: 1-bit compression sends it +-scale while its variance is 0), and later only a warning said why. Now, with no
    option and no callback, those rows stay where they were (their momentum is zeroed after every exchange) while the
    used rows train, and rank 0 says so once, in two lines at most, naming the parameter and how to train such rows
    instead; rank 1 does not repeat it. Only the parameter that has dead coordinates keeps a mask (one bool per
    element); an explicit mask that covers half of them leaves the other half to the default."""
    results = scenario_results(session, "dead")
    for rank, result in enumerate(results):
        r = result["default"]
        assert r["error"] is None and r["steps"] == STEPS and r["finite"], r
        assert max(r["unused"]) == r["unused"][0], r["unused"]  # at rest (weight decay is 0 here)
        assert r["used"][-1] != r["used"][FREEZE - 1]  # the live rows go on training
        assert r["kept"] == VOCAB * DIM, r["kept"]  # emb.weight only
        assert max(result["half"]["unused"]) == result["half"]["unused"][0]
        if rank == 0:
            assert len(r["warnings"]) == 1, r["warnings"]
            message = r["warnings"][0]
            assert message.count("\n") == 0 and len(message) <= 2 * 120, message
            for fragment in (
                f"OnebitAdam: {DEAD} coordinate(s) had no gradient in warmup (parameter 0 of param group 0 (shape "
                f"(20, 8)): {DEAD} of 160) and stay at rest; to train them, use a \"compress\": False param group.",
                "see docs/guides/freeze-step.md#embedding-tables",
            ):
                assert fragment in message, (fragment, message)
            named = result["named"]["warnings"]
            assert f"'emb.weight' (param group 0, index 0, shape (20, 8)): {DEAD} of 160" in named[0], named
            half = result["half"]["warnings"]
            assert len(half) == 1 and f": {DEAD // 2} of 160" in half[0], half
        else:
            assert r["warnings"] == [] and result["named"]["warnings"] == [] and result["half"]["warnings"] == []


def test_dead_coordinates_warn_ignore_and_momentum_mask_auto(session: list[dict[str, Any]]) -> None:
    """``dead_coordinates="warn"`` with ``cap_update=False`` keeps DeepSpeed's behaviour (the rows jump) and says so
    on rank 0; ``"ignore"`` neither looks nor warns (the jump, silently); with the update's cap (the default) the
    unmasked rows move, but by at most ``lr * B`` per compressed step (``adam_step_bound``), not ``lr * scale / eps``;
    ``MomentumMask(auto=True)`` masks the rows itself and reports them, so the optimizer does not warn a second
    time."""
    for rank, result in enumerate(scenario_results(session, "dead")):
        for name in ("warn", "off"):
            r = result[name]
            assert r["error"] is None and r["steps"] == STEPS and r["kept"] == 0, (name, r)
            assert max(r["unused"][:FREEZE]) < 10 and r["unused"][FREEZE] > 1000, (name, r["unused"])  # the jump
        capped = result["warn_capped"]
        assert capped["error"] is None and capped["steps"] == STEPS and capped["kept"] == 0, capped
        lr = TokenRegressor().lr
        for t in range(FREEZE + 1, STEPS + 1):  # each compressed step moves them, within lr * B
            moved = abs(capped["unused"][t - 1] - capped["unused"][t - 2])
            assert 0 < moved <= lr * adam_step_bound((0.9, 0.999)) * (1 + 1e-3), (t, capped["unused"])
        warned = result["warn"]["warnings"]
        if rank == 0:
            assert len(warned) == 1 and "are not masked (dead_coordinates='warn')" in warned[0], warned
        else:
            assert warned == []
        assert result["off"]["warnings"] == []
        auto = result["auto"]
        assert auto["error"] is None and auto["warnings"] == [] and max(auto["unused"]) == auto["unused"][0], auto


def test_dead_coordinates_single_process_and_across_a_resume() -> None:
    """Without Lightning: a standalone optimizer keeps the rows no batch looked up at rest and warns once, coordinates
    an explicit mask covers are not counted; the dead coordinates come from the variance, so a resume in warmup counts
    the steps before it too (it used to see only the steps after it), and after a resume in the compression stage the
    rows are still at rest."""
    def run(opt: OnebitAdam, emb: nn.Embedding, steps: int) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                opt.zero_grad()
                emb(torch.tensor([0, 1, 2])).sum().backward()
                opt.step()
        return [str(w.message) for w in caught if str(w.message).startswith("OnebitAdam")]

    emb = nn.Embedding(6, 2)
    mask = torch.ones(6, 2)
    mask[5] = 0
    opt = OnebitAdam([{"params": [emb.weight], "exp_avg_mask": [mask]}], freeze_step=3)
    before = emb.weight.detach().clone()
    messages = run(opt, emb, 5)
    assert len(messages) == 1 and ": 4 of 12" in messages[0], messages
    assert torch.equal(emb.weight[3:], before[3:]) and not torch.equal(emb.weight[:3], before[:3])

    emb2 = nn.Embedding(6, 2)
    opt2 = OnebitAdam(emb2.parameters(), freeze_step=3)
    run(opt2, emb2, 1)
    resumed = OnebitAdam(emb2.parameters(), freeze_step=3)
    resumed.load_state_dict(copy.deepcopy(opt2.state_dict()))
    before = emb2.weight.detach().clone()
    messages = run(resumed, emb2, 3)
    assert len(messages) == 1 and ": 6 of 12" in messages[0], messages
    again = OnebitAdam(emb2.parameters(), freeze_step=3)
    again.load_state_dict(copy.deepcopy(resumed.state_dict()))  # in the compression stage
    messages = run(again, emb2, 2)
    assert len(messages) == 1 and ": 6 of 12" in messages[0], messages
    assert torch.equal(emb2.weight[3:], before[3:])


# ======================================================================================== smaller: other arguments
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"bias_correction": "no"}, "bias_correction must be True or False, got 'no' (str) (param group 0)"),
        ({"bias_correction": 0}, "bias_correction must be True or False, got 0"),
        ({"betas": 0.9}, "betas must be a pair of floats (b1, b2), e.g. (0.9, 0.999); got 0.9 (param group 0)"),
        ({"betas": (0.9,)}, "betas must be a pair of floats"),
        ({"betas": ("0.9", 0.999)}, "betas must be a pair of floats"),
        ({"betas": (0.9, float("nan"))}, "betas must each be in [0, 1)"),
        ({"lr": "1e-3"}, "lr must be a finite number >= 0, got '1e-3' (str) (param group 0)"),
        ({"lr": torch.tensor(1e-3)}, "OnebitAdam takes lr as a float, not a tensor (param group 0); pass lr=float(lr)"),
        ({"eps": None}, "eps must be a finite number >= 0, got None"),
        ({"amsgrad": "no"}, "amsgrad must be False"),
        ({"bucket_cap_mb": "25"}, "bucket_cap_mb must be a number > 0 (MB) below 2**43 (its bytes must fit an "
                                  "int64), got '25' (str)"),
        ({"dead_coordinates": True}, "dead_coordinates must be one of ('mask', 'warn', 'ignore'), got True"),
    ],
)
def test_argument_errors_name_the_argument_at_construction(kwargs: dict[str, Any], message: str) -> None:
    """Used to: ``bias_correction="no"`` was truthy (bias correction on), ``betas=0.9`` raised "cannot unpack
    non-iterable float object" (no argument named), ``lr="1e-3"`` a TypeError from a comparison. Now a ``ValueError``
    naming the argument, raised by the constructor (no process group exists in this test process: no collective)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        OnebitAdam(nn.Linear(2, 1).parameters(), freeze_step=2, **kwargs)
    # group options are checked the same way, and a list from YAML is a valid pair
    opt = OnebitAdam([{"params": nn.Linear(2, 1).parameters(), "betas": [0.8, 0.99]}], freeze_step=2)
    assert opt.param_groups[0]["betas"] == (0.8, 0.99)


# ====================================================================================== porting from torch.optim.AdamW
OPTIMIZERS = [OnebitAdam, ZeroOneAdam, OnebitLamb]
#: The AdamW options that change the math or how a step may run, and a piece of the fix each error names.
REFUSED_ADAMW_OPTIONS = [
    ("amsgrad", "drop the argument"),
    ("maximize", "minimise the negated objective instead"),
    ("differentiable", "the 1-bit exchange has no gradient"),
    ("capturable", "cannot capture"),
]


def _optimizer(cls: type, params: Any, **kwargs: Any) -> Any:
    """``cls`` over ``params`` with its warmup ending after step 2 (ZeroOneAdam: two variance steps, then 1-bit)."""
    if cls is ZeroOneAdam:
        return cls(params, var_update_scaler=2, var_freeze_step=4, local_step_scaler=2, **kwargs)
    return cls(params, freeze_step=2, **kwargs)


def _trained(cls: type, steps: int = 4, **kwargs: Any) -> list[torch.Tensor]:
    """The parameters of a small linear model after ``steps`` steps of ``cls`` in one process (no process group: the
    compressed average is the identity, the compressed steps still run)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = _optimizer(cls, model.parameters(), lr=1e-2, **kwargs)
    x = torch.randn(8, 4)
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name, fix", REFUSED_ADAMW_OPTIONS, ids=[n for n, _ in REFUSED_ADAMW_OPTIONS])
@pytest.mark.parametrize("value", [True, "no", 1])
def test_adamw_options_that_change_the_math_are_refused_with_the_fix(
    cls: type, name: str, fix: str, value: Any
) -> None:
    """Used to: ``OnebitAdam(..., maximize=True)`` (any of these but OnebitAdam's and ZeroOneAdam's ``amsgrad``) was a
    bare ``TypeError: unexpected keyword argument``; OnebitLamb took no ``amsgrad`` at all. Now a ``ValueError`` that
    names the argument, the value and what to do instead, from every optimizer; ``False`` (AdamW's default) ports."""
    with pytest.raises(ValueError, match=re.escape(f"{name} must be False, got {value!r}: {cls.__name__} does not "
                                                   f"support {name}")) as caught:
        _optimizer(cls, nn.Linear(2, 1).parameters(), **{name: value})
    assert fix in str(caught.value)
    _optimizer(cls, nn.Linear(2, 1).parameters(), **{name: False})


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_foreach_and_fused_are_taken_change_nothing_and_say_so_once(cls: type) -> None:
    """Used to: ``foreach=True`` / ``fused=True`` from an AdamW config were a bare ``TypeError``. They choose torch's
    implementation of the same math, and these optimizers choose their kernels themselves: ``None`` (torch's default)
    is taken silently, ``True``/``False`` with one ``UserWarning`` per call site that names the argument and says it
    has no effect, pointing at the caller's line; the trained parameters are bitwise those without it (warmup and
    compressed steps); a value that is no flag is refused."""
    expected = _trained(cls)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("error")
        assert all(torch.equal(a, b) for a, b in zip(_trained(cls, foreach=None, fused=None), expected))
    assert caught == []
    for name, value in (("foreach", True), ("fused", True), ("foreach", False), ("fused", False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")  # Python's default: once per call site
            for _ in range(3):
                _optimizer(cls, nn.Linear(2, 1).parameters(), **{name: value})
        assert [str(w.message) for w in caught] == [
            f"{cls.__name__}({name}={value}) has no effect: {cls.__name__} chooses its kernels itself (torch's "
            "multi-tensor and fused kernels where they apply, kernel_backend for the 1-bit exchange), and the "
            f"results do not depend on it. Drop {name}={value} to silence this warning."
        ]
        assert caught[0].category is UserWarning and caught[0].filename == __file__
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert all(torch.equal(a, b) for a, b in zip(_trained(cls, **{name: value}), expected))
    with pytest.raises(ValueError, match=re.escape("fused must be True or False, got 'yes' (str); or None (the "
                                                   f"default: {cls.__name__} chooses its kernels itself)")):
        _optimizer(cls, nn.Linear(2, 1).parameters(), fused="yes")


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_weight_decay_defaults_to_zero_where_adamw_defaults_to_a_hundredth(cls: type) -> None:
    """The docs and docstrings say a port must pass weight_decay: check the figures they give against the code."""
    import inspect

    assert inspect.signature(torch.optim.AdamW).parameters["weight_decay"].default == 0.01
    assert inspect.signature(cls).parameters["weight_decay"].default == 0.0
    assert _optimizer(cls, nn.Linear(2, 1).parameters()).param_groups[0]["weight_decay"] == 0.0
    assert "``torch.optim.AdamW``'s is" in cls.__doc__ or "``torch.optim.AdamW``'s default is ``0.01``" in cls.__doc__


# ======================================================================================== non-finite numbers
@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", ["lr", "eps", "weight_decay"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), float("-inf"), -1.0])
def test_non_finite_or_negative_lr_eps_weight_decay_are_refused_in_init_and_add_param_group(
    cls: type, name: str, value: float
) -> None:
    """Used to: ``lr``, ``eps`` or ``weight_decay`` of ``inf`` were taken by all three optimizers (the parameters were
    NaN after two steps, or stopped moving), in the constructor and in ``add_param_group``. Now a ``ValueError``
    naming the option, the value, the group and an example, and the refused group is not added."""
    message = f"{name} must be a finite number >= 0, got {value!r} (param group %d); e.g. {name}="
    with pytest.raises(ValueError, match=re.escape(message % 0)):
        _optimizer(cls, nn.Linear(2, 1).parameters(), **{name: value})
    opt = _optimizer(cls, nn.Linear(2, 1).parameters())
    with pytest.raises(ValueError, match=re.escape(message % 1)):
        opt.add_param_group({"params": nn.Linear(2, 1).parameters(), name: value})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match=re.escape(message % 0)):
        _optimizer(cls, [{"params": nn.Linear(2, 1).parameters(), name: value}])


def test_the_weight_decay_error_names_adamws_default() -> None:
    with pytest.raises(ValueError, match=re.escape("e.g. weight_decay=0.01 (torch.optim.AdamW's default; this "
                                                   "optimizer's is 0)")):
        OnebitAdam(nn.Linear(2, 1).parameters(), weight_decay=float("inf"))


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_lr_schedulers_still_drive_the_learning_rate(cls: type) -> None:
    """A scheduler sets ``group["lr"]`` after construction (not through ``add_param_group``), and OneCycleLR adds its
    own keys to the groups: both keep working, through warmup and compressed steps, and the update follows the
    scheduled rate (a scheduled rate of 0 leaves the parameters where they are)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = _optimizer(cls, model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=6)
    # the same schedule on a plain torch optimizer: the rates it sets are the reference
    reference = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-2)
    reference_scheduler = torch.optim.lr_scheduler.OneCycleLR(reference, max_lr=0.05, total_steps=6)
    x, rates = torch.randn(8, 4), []
    for _ in range(5):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        reference.step()
        scheduler.step()
        reference_scheduler.step()
        rates.append(opt.param_groups[0]["lr"])
        assert rates[-1] == reference.param_groups[0]["lr"]
    assert len(set(rates)) == 5 and all(torch.isfinite(p).all() for p in model.parameters())
    lambda_opt = _optimizer(cls, model.parameters(), lr=1e-2)
    torch.optim.lr_scheduler.LambdaLR(lambda_opt, lambda step: 0.0)
    before = [p.detach().clone() for p in model.parameters()]
    lambda_opt.zero_grad()
    model(x).square().mean().backward()
    lambda_opt.step()
    assert lambda_opt.param_groups[0]["lr"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


# ======================================================================================== bucket sizes, process group
@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 0, -1.0, 2.0**43, True, "25"])
def test_a_bucket_size_that_is_no_positive_finite_number_is_refused(cls: type, value: Any) -> None:
    """Used to: ``bucket_cap_mb=inf`` raised a bare ``OverflowError`` (converting the byte count), and sizes whose
    bytes do not fit an int64 were taken. Now a ``ValueError`` with the argument, the value and an example."""
    message = f"bucket_cap_mb must be a number > 0 (MB) below 2**43 (its bytes must fit an int64), got {value!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        _optimizer(cls, nn.Linear(2, 1).parameters(), bucket_cap_mb=value)
    assert _optimizer(cls, nn.Linear(2, 1).parameters(), bucket_cap_mb=2.0**43 - 1).momentum_buckets is not None


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_a_process_group_that_is_no_process_group_is_refused_at_construction(cls: type) -> None:
    """Used to: ``process_group="x"`` was taken and failed at the first compressed step (a collective)."""
    with pytest.raises(ValueError, match=re.escape("process_group must be a torch.distributed.ProcessGroup or None "
                                                   "(WORLD), got 'x'")):
        _optimizer(cls, nn.Linear(2, 1).parameters(), process_group="x")


# ====================================================================================== ZeroOneAdam.fit_schedule_to_run
@pytest.mark.parametrize("total", [-1, 0, True, 2.5, 100.0, float("nan"), float("inf"), "100"])
def test_fit_schedule_to_run_takes_a_positive_integer_or_none(total: Any) -> None:
    """Used to: -1, 0, True and 2.5 were taken (schedules scaled to nonsense: var_freeze_step 1 for -1), NaN and inf
    gave bare ValueError/OverflowError from ``round``, '100' a TypeError. Now a ``ValueError`` naming the argument,
    also when every schedule argument was given (nothing to scale)."""
    message = ("ZeroOneAdam.fit_schedule_to_run total_steps must be an integer >= 1 (the run's length in optimizer "
               f"steps) or None, got {total!r}")
    opt = ZeroOneAdam(nn.Linear(2, 1).parameters())
    with pytest.raises(ValueError, match=re.escape(message)):
        opt.fit_schedule_to_run(total)
    assert (opt.var_freeze_step, opt.var_update_scaler) == (100000, 16)  # untouched
    given = ZeroOneAdam(nn.Linear(2, 1).parameters(), var_freeze_step=8, var_update_scaler=2, local_step_scaler=2)
    with pytest.raises(ValueError, match=re.escape(message)):
        given.fit_schedule_to_run(total)
    assert opt.fit_schedule_to_run(200) is not None and (opt.var_freeze_step, opt.var_update_scaler) == (100, 20)
    assert given.fit_schedule_to_run(None) is None


# ======================================================================================== OnebitLamb's group options
@pytest.mark.parametrize(
    "option, value, message",
    [
        ("max_coeff", float("inf"), "max_coeff must be a finite number, got inf (param group 1)"),
        ("min_coeff", float("nan"), "min_coeff must be a finite number, got nan (param group 1)"),
        ("min_coeff", 0.0, "need 0 < min_coeff <= max_coeff, got min_coeff=0.0, max_coeff=10.0 (param group 1)"),
        ("factor_threshold", -0.1, "factor_threshold must be a finite number >= 0, got -0.1 (param group 1)"),
        ("coeff_beta", 1.0, "coeff_beta must be a finite number in [0, 1), got 1.0 (param group 1)"),
        ("cap_trust_ratio", "yes", "cap_trust_ratio must be True or False, got 'yes' (str) (param group 1)"),
    ],
)
def test_onebit_lambs_options_are_checked_per_param_group(option: str, value: Any, message: str) -> None:
    """Used to: LAMB's options were checked only as constructor arguments; set in a param group (``{"params": ...,
    "max_coeff": inf}``) they were taken and reached the trust ratios. Now every group's are checked when it is
    added, and the group is not added."""
    opt = OnebitLamb(nn.Linear(2, 1).parameters(), freeze_step=2)
    with pytest.raises(ValueError, match=re.escape(message)):
        opt.add_param_group({"params": nn.Linear(2, 1).parameters(), option: value})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match=re.escape(message)):
        OnebitLamb([{"params": nn.Linear(2, 1).parameters()}, {"params": nn.Linear(2, 1).parameters(), option: value}],
                   freeze_step=2)
    opt.add_param_group({"params": nn.Linear(2, 1).parameters(), "max_coeff": 5, "cap_trust_ratio": False})
    assert opt.param_groups[1]["max_coeff"] == 5.0 and isinstance(opt.param_groups[1]["max_coeff"], float)


# ======================================================================================== AutoFreeze
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(seed="x"), "AutoFreeze seed must be an integer (the seed of the coordinate sample, in [-2**63, "
                         "2**64 - 1]), got 'x' (str); e.g. seed=0"),
        (dict(seed=1.5), "AutoFreeze seed must be an integer"),
        (dict(seed=True), "AutoFreeze seed must be an integer"),
        (dict(seed=2**64), "AutoFreeze seed must be an integer"),
        (dict(seed=-(2**63) - 1), "AutoFreeze seed must be an integer"),
        (dict(sample_size=2.0), "AutoFreeze sample_size must be an integer >= 1, got 2.0"),
        (dict(window=True), "AutoFreeze window must be an integer >= 1 or None, got True (bool)"),
        (dict(max_step=float("inf")), "AutoFreeze max_step must be an integer >= 1 or None, got inf"),
        (dict(check_every="4"), "AutoFreeze check_every must be an integer >= 1 or None, got '4' (str)"),
        (dict(patience=0), "AutoFreeze patience must be an integer >= 1, got 0"),
        (dict(threshold=float("nan")), "AutoFreeze threshold must be a finite number > 0, got nan"),
        (dict(tensor_threshold=True), "AutoFreeze tensor_threshold must be a finite number > 0, got True (bool)"),
        (dict(loss_drop=float("nan")), "AutoFreeze loss_drop must be a finite number in [0, 1) or None, got nan"),
    ],
)
def test_every_auto_freeze_argument_is_checked_at_construction(kwargs: dict[str, Any], message: str) -> None:
    """Used to: ``AutoFreeze(seed="x")`` (or 1.5, True, 2**64) was taken and failed at the first check step in
    ``torch.Generator.manual_seed``, in the middle of training. Now every argument's type and range is checked when
    the settings are made; a negative seed is in torch's range and draws the same sample every time."""
    with pytest.raises(ValueError, match=re.escape(message)):
        AutoFreeze(**kwargs)
    from lightning_onebit.optim.auto_freeze_figures import draw_sample

    seed = AutoFreeze(seed=-1).seed
    first, again = draw_sample([50, 50], 10, seed), draw_sample([50, 50], 10, seed)
    assert sum(len(i) for _, i in first) == 10
    assert all(a == b and torch.equal(x, y) for (a, x), (b, y) in zip(first, again))
