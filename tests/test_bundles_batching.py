"""batching: the row-choosing policies, and the hooks against SGLang 0.5.23's own DSpark planner
and scheduler code (compiled from the installed wheel, run on CPU)."""

from __future__ import annotations

import ast
import math
import random
import sys
import types
from types import SimpleNamespace

import pytest

from specpilot.bundles import batching
from specpilot.bundles import plugin
from sglang_support import SKIP_REASON, load_sglang_function, sglang_dir

SGL = sglang_dir()
PLANNER = "sglang.srt.speculative.dspark_components.dspark_planner"
SCHEDULE = "sglang.kernels.ops.speculative.dspark.dspark_schedule"


def _lattice(rng, m=4, k=3):
    tokens = [rng.sample(range(100), k) for _ in range(m)]
    logp = []
    for _ in range(m):
        w = [rng.random() + 1e-3 for _ in range(k)]
        z = sum(w)
        logp.append(sorted((math.log(x / z) for x in w), reverse=True))
    return tokens, logp, None


def test_shared_budget_is_spent_on_the_best_paths_and_every_share_is_a_tree():
    pytest.importorskip("specpilot.kernels.tree")
    rng = random.Random(0)
    lattices = [_lattice(rng) for _ in range(3)]
    trees = batching.shared_budget_trees(lattices, 10)
    assert sum(len(t) for t in trees) == 10
    taken = []
    for t in trees:
        for i, p in enumerate(t.parents):
            assert p < i  # prefix-closed, parents first
        taken += list(t.score)
    # nothing left out scores higher than the worst node taken (best-first over all requests)
    more = batching.shared_budget_trees(lattices, 11)
    extra = sorted(s for t in more for s in t.score)[0]
    assert extra <= min(taken) + 1e-12


def test_block_policy_steps_down_with_acceptance():
    pol = batching.BlockPolicy()
    assert pol.choose([]) == 16
    assert pol.choose([12, 11, 10]) == 16       # mean 11 > 0.75 * 12
    assert pol.choose([7, 8, 6]) == 12          # 7 <= 9, but > 0.75 * 8
    assert pol.choose([2, 3, 1]) == 8


def test_prompt_admission_takes_only_short_prompts_that_fit():
    assert batching.admit_prompts([100, 500, 200, 90], free_rows=320) == [0, 2]
    assert batching.admit_prompts([400], free_rows=1000) == []
    assert batching.admit_prompts([], free_rows=10) == []


def test_shared_extra_budget():
    assert batching.shared_extra_budget(24, 192, 1, 9) == 168      # 192 rows, 24 of them anchors
    assert batching.shared_extra_budget(30, 192, 1, 5) == 120      # capped: 30 requests x 4 drafts
    assert batching.shared_extra_budget(300, 192, 1, 9) == 0       # every request keeps its anchor


def test_merge_queue_keeps_order_of_the_waiting():
    a, b, c, d, e = (object() for _ in range(5))
    # shown b, d; SGLang admitted b, kept d, and requeued e during the call
    assert batching.merge_queue([a, b, c, d], [b, d], [d, e]) == [a, c, d, e]
    assert batching.merge_queue([a, b], [], [a, b]) == [a, b]


# -------------------------------------------------------------- SGLang's own code (from the wheel)

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def sgl():
    if SGL is None:
        pytest.skip(SKIP_REASON)
    ns = {"torch": torch, "Optional": __import__("typing").Optional}
    f = {}
    for name in ("compute_sort_survival", "_value_independent_descending_order",
                 "schedule_verify_lens_topk_from_survival", "schedule_verify_lens_topk"):
        f[name] = load_sglang_function(SGL, SCHEDULE, name, ns)
    f["resolved_max_verify_len"] = load_sglang_function(SGL, PLANNER, "DSparkScheduleConfig.resolved_max_verify_len", ns)
    f["local_verify_tier_num_tokens"] = load_sglang_function(SGL, PLANNER, "local_verify_tier_num_tokens", ns)
    checked = []
    ns.update({
        "ScheduleVerifyLensTopk": SimpleNamespace(execute=lambda **kw: f["schedule_verify_lens_topk"](**kw)),
        "SpecTpSyncSite": SimpleNamespace(DSPARK_PLAN=7),
        "resolve_level": lambda: 2, "InvariantCheckLevel": SimpleNamespace(WARN=1),
        "expect": lambda inv, ok, msg="": checked.append(bool(ok)), "_VERIFY_LEN_BUDGET": "budget",
        "envs": SimpleNamespace(SGLANG_DSPARK_DEBUG_CONFIDENCE_PREFIX_SCHEDULER=SimpleNamespace(get=lambda: False)),
    })
    f["schedule"] = load_sglang_function(SGL, PLANNER, "DSparkVerifyPlanner._schedule_verify_lens", ns)
    f["budget"] = load_sglang_function(SGL, PLANNER, "DSparkVerifyPlanner._budget_from_resolved", ns)
    f["defer"] = load_sglang_function(SGL, "sglang.srt.managers.scheduler", "Scheduler._should_defer_prefill", ns)
    f["invariant"] = checked
    return f


class Cfg:
    """DSparkScheduleConfig's fields; its method is SGLang's (bound in the fixture)."""

    def __init__(self, gamma, min_verify_len=1, max_verify_len=0, survival_eps=1e-6):
        self.gamma, self.min_verify_len, self.max_verify_len, self.survival_eps = (
            gamma, min_verify_len, max_verify_len, survival_eps)


def _planner(sgl, gamma, pool=64, **cfg):
    Cfg.resolved_max_verify_len = sgl["resolved_max_verify_len"]
    return SimpleNamespace(
        _budget_planner=SimpleNamespace(forced_budget_frac=None, last_decision=None),
        _schedule_cfg=Cfg(gamma, **cfg), _is_verify_all=False,
        _tp_sync=SimpleNamespace(sync=lambda site, t: None),
        model_runner=SimpleNamespace(req_to_token_pool=SimpleNamespace(
            req_to_token=torch.zeros(pool, 1), req_generation=torch.ones(pool, dtype=torch.int64))))


def _conf(gen, bs, gamma):
    return (0.35 + 0.65 * torch.rand(bs, gamma, generator=gen)).to(torch.float32)


@pytest.fixture
def fresh(monkeypatch):
    batching.history().clear()
    monkeypatch.setattr(plugin, "_settings", {})
    yield
    batching.history().clear()


def _schedule(sgl, planner, conf, rows, budget, hook=True):
    kw = dict(req_pool_indices=rows, prefix_lens=torch.zeros(len(rows), dtype=torch.int64),
              device=torch.device("cpu"), confidence=conf, budget=budget)
    if hook:
        return batching.around_schedule_verify_lens(sgl["schedule"], planner, **kw)
    return sgl["schedule"](planner, **kw)


def test_schedule_with_every_block_at_least_the_draft_is_stock(sgl, fresh):
    gen = torch.Generator().manual_seed(0)
    for bs, gamma, budget in [(5, 7, 12), (8, 8, 30), (3, 16, 20)]:
        planner = _planner(sgl, gamma)
        conf, rows = _conf(gen, bs, gamma), torch.randperm(40, generator=gen)[:bs]
        want = _schedule(sgl, planner, conf, rows, budget, hook=False)
        got = _schedule(sgl, planner, conf, rows, budget)
        assert got.dtype == want.dtype == torch.int32 and got.shape == want.shape == (bs,)
        assert torch.equal(got, want)


def test_shared_budget_schedule_equals_the_shared_best_first_builder(sgl, fresh):
    """SGLang's own top-k over the (capped) confidence gives each request exactly the positions
    the paper's shared builder (specpilot.kernels.tree) gives it over the same chains."""
    pytest.importorskip("specpilot.kernels.tree")
    gen = torch.Generator().manual_seed(1)
    policy = batching.block_policy()
    for trial in range(6):
        bs, gamma = 6, 16
        planner = _planner(sgl, gamma)
        rows = torch.arange(bs) * 3 + trial
        for b in range(bs):  # half the requests accept little: their block drops to 8
            for _ in range(4):
                batching.after_resolve_spec_v2_tokens(
                    None, None, SimpleNamespace(num_correct_drafts_per_req_cpu=[2 if b % 2 else 15]),
                    SimpleNamespace(reqs=[SimpleNamespace(kv=SimpleNamespace(req_pool_idx=int(rows[b])), rid=f"r{b}",
                                                          finished=lambda: False)]))
        conf = (0.8 + 0.2 * torch.rand(bs, gamma, generator=gen)).to(torch.float32)  # long chains
        budget = batching.shared_extra_budget(bs, 64, 1, gamma + 1)
        stock = _schedule(sgl, planner, conf, rows, budget, hook=False)
        got = _schedule(sgl, planner, conf, rows, budget)
        caps = torch.tensor([8 if b % 2 else 16 for b in range(bs)])
        assert torch.any(stock - 1 > caps) and torch.any(got - 1 == caps)  # the blocks did bind
        assert policy.choose([2] * 4) == 8 and policy.choose([15] * 4) == 16
        assert got.dtype == torch.int32 and got.shape == (bs,)
        assert torch.all(got <= 1 + caps) and int((got - 1).sum()) <= budget
        masked = batching.mask_confidence(conf, caps)
        assert batching.shared_chain_lengths(masked.tolist(), budget) == (got - 1).tolist()
        # the budget the capped requests could not use went to the others: the step is full
        assert int((got - 1).sum()) == budget
    assert all(sgl["invariant"])  # SGLang's own budget invariant held on every call


def test_mask_confidence_contract():
    conf = torch.rand(3, 6).to(torch.bfloat16)
    out = batching.mask_confidence(conf, torch.tensor([0, 2, 9], dtype=torch.int32))
    assert out.dtype == conf.dtype and out.shape == conf.shape
    assert torch.all(out[0] == 0) and torch.equal(out[1, :2], conf[1, :2]) and torch.all(out[1, 2:] == 0)
    assert torch.equal(out[2], conf[2])


def test_block_history_resets_for_a_new_request(fresh):
    h, pol = batching.history(), batching.BlockPolicy()
    owner = SimpleNamespace()
    for _ in range(3):
        h.observe(5, "old", 1, pol, 8)
    assert h.caps_for(owner, torch.tensor([5, 6]), 16, 16).tolist() == [8, 16]
    h.observe(5, "new", 14, pol, 8)       # another request took slot 5
    assert h.caps_for(owner, torch.tensor([5]), 16, 16).tolist() == [16]
    for _ in range(3):
        h.observe(6, "x", 0, pol, 8)
    h.forget(6, pol)                      # admitted again: starts with the largest block
    assert h.caps_for(owner, torch.tensor([6]), 16, 16).tolist() == [16]


def test_budget_hook_gives_the_shared_budget_and_the_tier_follows(sgl, fresh):
    gamma, bs = 7, 30
    planner = _planner(sgl, gamma)
    calls = []

    def compute_budget(**kw):
        calls.append(kw)
        return 5

    planner._budget_planner.compute_budget = compute_budget
    planner._budget_planner.note_non_decode_step = lambda: calls.append("nd")
    planner._budget_planner.last_decision = SimpleNamespace(budget=5)
    resolved = SimpleNamespace(confidence=torch.rand(bs, gamma), generation=torch.ones(bs, dtype=torch.int64))
    rows = torch.arange(bs)
    assert sgl["budget"](planner, resolved=resolved, req_pool_indices_cpu=rows) == 5
    got = batching.around_budget_from_resolved(sgl["budget"], planner, resolved=resolved, req_pool_indices_cpu=rows)
    assert isinstance(got, int) and got == 192 - bs and len(calls) == 2  # SGLang's planner still ran
    assert planner._budget_planner.last_decision.budget == got
    tier = sgl["local_verify_tier_num_tokens"](bs=bs, verify_token_budget=got, verify_num_draft_tokens=gamma + 1,
                                                min_verify_len=1)
    assert tier == 192  # the step verifies exactly the shared budget of rows
    # passes through: no confidence this step, a forced fraction, a verify-all planner, budget 0
    assert batching.around_budget_from_resolved(sgl["budget"], planner, resolved=None, req_pool_indices_cpu=rows) is None
    planner._budget_planner.forced_budget_frac = 0.5
    assert batching.around_budget_from_resolved(sgl["budget"], planner, resolved=resolved, req_pool_indices_cpu=rows) == 5
    planner._budget_planner.forced_budget_frac = None
    plugin._settings["shared_budget"] = 0
    assert batching.around_budget_from_resolved(sgl["budget"], planner, resolved=resolved, req_pool_indices_cpu=rows) == 5


def test_planner_init_turns_off_verify_all_only_with_a_shared_budget(fresh):
    planner = SimpleNamespace(_budget_planner=object(), _is_verify_all=True)
    assert batching.after_planner_init(None, planner) is None and planner._is_verify_all is False
    static = SimpleNamespace(_budget_planner=None, _is_verify_all=True)  # static mode: no budget planner
    batching.after_planner_init(None, static)
    assert static._is_verify_all is True
    plugin._settings["shared_budget"] = 0
    off = SimpleNamespace(_budget_planner=object(), _is_verify_all=True)
    batching.after_planner_init(None, off)
    assert off._is_verify_all is True


def _sglang_function(module, qualname):
    path = SGL / (module.replace(".", "/") + ".py")
    tree = ast.parse(path.read_text())
    cls, name = qualname.split(".")
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == name)


def test_stock_functions_keep_the_contracts_the_hooks_rely_on(sgl):
    """What the AFTER/AROUND handlers read or restore is where SGLang 0.5.23 puts it."""
    fn = _sglang_function("sglang.srt.managers.scheduler_components.batch_result_processor",
                          "SchedulerBatchResultProcessor._resolve_spec_v2_tokens")
    src = ast.unparse(fn)
    assert "result.num_correct_drafts_per_req_cpu = " in src and "for i, req in enumerate(batch.reqs)" in src
    fn = _sglang_function("sglang.srt.managers.scheduler", "Scheduler._get_new_batch_prefill_raw")
    src = ast.unparse(fn)
    assert "for req in self.waiting_queue:" in src
    assert "self.waiting_queue = [x for x in self.waiting_queue if x not in can_run_set]" in src
    assert "new_batch.decoding_reqs = running_batch.reqs" in src


def _req(n, rid):
    return SimpleNamespace(origin_input_ids=[0] * n, rid=rid)


def test_admission_only_in_steps_sglang_defers(sgl, fresh):
    queue = [_req(900, "long"), _req(100, "a"), _req(300, "b"), _req(50, "c")]
    running = SimpleNamespace(batch_size=lambda: 8)
    sched = SimpleNamespace(_prefill_decode_interval_remaining=0, prefill_decode_interval_min_bs=0,
                            waiting_queue=list(queue), require_mlp_sync=False, chunked_req=None)
    assert batching.around_should_defer_prefill(sgl["defer"], sched, running) is False  # stock admits anyway
    assert getattr(sched, batching._ADMIT_ATTR, None) is None
    sched._prefill_decode_interval_remaining = 2
    assert batching.around_should_defer_prefill(sgl["defer"], sched, running) is False
    assert sched._prefill_decode_interval_remaining == 1  # SGLang's own counter advanced
    assert [r.rid for r in getattr(sched, batching._ADMIT_ATTR)] == ["a", "c"]  # 384 rows: a, then b does not fit

    seen = []

    def prefill_raw(self, delayer, running_batch):  # stock's queue contract (see the test above)
        seen.extend(r.rid for r in self.waiting_queue)
        admitted = self.waiting_queue[:1]
        self.waiting_queue = [x for x in self.waiting_queue if x not in admitted]
        new = SimpleNamespace(reqs=[SimpleNamespace(kv=SimpleNamespace(req_pool_idx=3), rid=admitted[0].rid)],
                              decoding_reqs=None)
        return new, running_batch

    new, _ = batching.around_get_new_batch_prefill_raw(prefill_raw, sched, None, running)
    assert seen == ["a", "c"] and new.reqs[0].rid == "a"
    assert [r.rid for r in sched.waiting_queue] == ["long", "b", "c"]
    assert getattr(sched, batching._ADMIT_ATTR) is None
    assert batching.history().pending == {3: 16}  # the admitted request starts with the largest block
    # the next prefill (not a deferred step) sees the whole queue
    seen.clear()
    batching.around_get_new_batch_prefill_raw(prefill_raw, sched, None, running)
    assert seen == ["long", "b", "c"]


@pytest.mark.parametrize("case", ["dp", "chunked", "off", "nothing_short"])
def test_admission_leaves_stock_deferral(sgl, fresh, case):
    sched = SimpleNamespace(_prefill_decode_interval_remaining=3, prefill_decode_interval_min_bs=0,
                            waiting_queue=[_req(100, "a")], require_mlp_sync=case == "dp",
                            chunked_req=object() if case == "chunked" else None)
    if case == "off":
        plugin._settings["admit_max_prompt"] = 0
    if case == "nothing_short":
        sched.waiting_queue = [_req(1000, "x")]
    assert batching.around_should_defer_prefill(sgl["defer"], sched, SimpleNamespace(batch_size=lambda: 8)) is True
    assert getattr(sched, batching._ADMIT_ATTR, None) is None


def test_hooks_through_sglangs_hook_registry(sgl, fresh):
    """The applied hook set, registered with SGLang's own HookRegistry on stand-in classes that
    carry SGLang's own methods (compiled from the wheel), called the way SGLang calls them."""
    from specpilot.bundles.memory import hooks_of, load_memory
    from sglang_support import load_sglang_module_file

    reg = load_sglang_module_file(SGL, "sglang.srt.plugins.hook_registry", "_sp_hook_registry_batching")
    reg.HookRegistry.reset()
    fake = types.ModuleType("_sp_fake_batching")

    class DSparkVerifyPlanner:
        def __init__(self, *, draft_model, gamma, model_runner, device, tp_rank, verify_num_draft_tokens, tp_sync):
            self.__dict__.update(vars(_planner(sgl, gamma)))
            self._is_verify_all = True  # compact mode with a flat step-time table

        _budget_from_resolved = sgl["budget"]
        _schedule_verify_lens = sgl["schedule"]

    class SchedulerBatchResultProcessor:
        def _resolve_spec_v2_tokens(self, result, batch):
            result.num_correct_drafts_per_req_cpu = [1 for _ in batch.reqs]
            return [[0] for _ in batch.reqs]

    class Scheduler:
        _should_defer_prefill = sgl["defer"]

        def _get_new_batch_prefill_raw(self, prefill_delayer_single_pass, running_batch):
            admitted = list(self.waiting_queue)
            self.waiting_queue = []
            return SimpleNamespace(reqs=admitted, decoding_reqs=None), running_batch

    fake.DSparkVerifyPlanner, fake.Scheduler = DSparkVerifyPlanner, Scheduler
    fake.SchedulerBatchResultProcessor = SchedulerBatchResultProcessor
    sys.modules[fake.__name__] = fake
    try:
        for h in hooks_of(load_memory(), ["batching"]):
            where = "_sp_fake_batching." + ".".join(h.target.rsplit(".", 2)[-2:])
            reg.HookRegistry.register(where, plugin.resolve(h.handler), reg.HookType[h.type.upper()])
        reg.HookRegistry.apply_hooks()
        assert reg.HookRegistry._patched == {f"_sp_fake_batching.{t}" for t in (
            "DSparkVerifyPlanner.__init__", "DSparkVerifyPlanner._budget_from_resolved",
            "DSparkVerifyPlanner._schedule_verify_lens", "SchedulerBatchResultProcessor._resolve_spec_v2_tokens",
            "Scheduler._should_defer_prefill", "Scheduler._get_new_batch_prefill_raw")}

        planner = DSparkVerifyPlanner(draft_model=None, gamma=16, model_runner=None, device="cpu", tp_rank=0,
                                      verify_num_draft_tokens=17, tp_sync=None)
        assert planner._is_verify_all is False
        rows = torch.tensor([4, 9])
        reqs = [SimpleNamespace(kv=SimpleNamespace(req_pool_idx=int(r)), rid=f"r{int(r)}", finished=lambda: False)
                for r in rows]
        for _ in range(3):
            SchedulerBatchResultProcessor()._resolve_spec_v2_tokens(SimpleNamespace(), SimpleNamespace(reqs=reqs))
        planner._budget_planner.compute_budget = lambda **kw: 3
        planner._budget_planner.note_non_decode_step = lambda: None
        resolved = SimpleNamespace(confidence=torch.rand(2, 16), generation=torch.ones(2, dtype=torch.int64))
        budget = planner._budget_from_resolved(resolved=resolved, req_pool_indices_cpu=rows)
        assert budget == 32  # min(192 - 2 anchors, 2 requests x 16 drafts)
        lens = planner._schedule_verify_lens(req_pool_indices=rows, prefix_lens=torch.zeros(2), device="cpu",
                                             confidence=torch.ones(2, 16), budget=budget)
        assert lens.tolist() == [9, 9]  # both requests accept ~1 draft: block 8 (+ the anchor)

        sched = Scheduler()
        sched.__dict__.update(_prefill_decode_interval_remaining=1, prefill_decode_interval_min_bs=0,
                              waiting_queue=[_req(2000, "long"), _req(10, "short")], require_mlp_sync=False,
                              chunked_req=None)
        assert sched._should_defer_prefill(SimpleNamespace(batch_size=lambda: 4)) is False
        new, _ = sched._get_new_batch_prefill_raw(prefill_delayer_single_pass=None, running_batch=None)
        assert [r.rid for r in new.reqs] == ["short"] and [r.rid for r in sched.waiting_queue] == ["long"]
    finally:
        sys.modules.pop(fake.__name__, None)
        sys.modules.pop("_sp_hook_registry_batching", None)


def test_planner_hooks_stay_off_outside_compact_mode(sgl, fresh):
    """SGLang's cap-accept mode runs every row and only caps acceptance: the rules stay off."""
    planner = _planner(sgl, 16)
    planner.is_compact_mode = False
    planner._is_verify_all = True
    batching.after_planner_init(None, planner)
    assert planner._is_verify_all is True
    planner._is_verify_all = False
    planner._budget_planner.compute_budget = lambda **kw: 7
    resolved = SimpleNamespace(confidence=torch.rand(2, 16), generation=torch.ones(2, dtype=torch.int64))
    assert batching.around_budget_from_resolved(sgl["budget"], planner, resolved=resolved,
                                                req_pool_indices_cpu=torch.arange(2)) == 7
    batching.history().pending[0] = 8
    conf, rows = torch.ones(2, 16), torch.tensor([0, 1])
    assert torch.equal(_schedule(sgl, planner, conf, rows, 30), _schedule(sgl, planner, conf, rows, 30, hook=False))
