"""RL environments, rollouts and rewards without a model: registry, reasoning-gym scoring, the
tool-use protocol through the engine (a scripted runner), length penalty, dynamic sampling,
batches, the PNG writer, config errors. No compiles of the model: a few seconds."""

import json

import numpy as np
import pytest

from kdsa.infer.budget import BudgetConfig
from kdsa.infer.chat import AssistantOutput, Message, ToolCall, get_format
from kdsa.infer.engine import Engine
from kdsa.infer.tokenizer import ByteTokenizer
from kdsa.train.rl import rollout as ro
from kdsa.train.rl.config import RLConfig, apply_rl_overrides
from kdsa.train.rl.envs import Environment, Outcome, Task, make_env, register_env
from kdsa.train.rl.envs.tool_use import ToolLookupEnv
from kdsa.train.rl.plot import reward_curve
from kdsa.train.rl.sft import demonstration_row, sft_batch

ARITH = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=["+", "-"],
             allow_parentheses=False, allow_negation=False)


@pytest.fixture(scope="module")
def fmt():
    return get_format("k2", ByteTokenizer(384, flavor="k2"))


def test_registry_and_custom_env():
    @register_env("test_echo")
    class Echo(Environment):
        def task(self, index, split="train"):
            w = ["cat", "dog"][index % 2]
            return Task(self.domain, index, (Message("user", f"Say {w}."),), data=w)

        def respond(self, task, output, history):
            return Outcome(reward=float(output.content.strip() == task.data))

    e = make_env("test_echo", seed=3)
    assert e.domain == "test_echo" and e.respond(e.task(1), AssistantOutput(content="dog"),
                                                 ()).reward == 1.0
    with pytest.raises(ValueError, match="already registered"):
        register_env("test_echo")(Echo)
    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        make_env("nope")
    with pytest.raises(ValueError, match="unknown options"):
        make_env("test_echo", colour=1)


def test_reasoning_gym_adapter_scores_with_the_family_verifier():
    env = make_env("rg:basic_arithmetic", seed=5, **ARITH)
    t = env.task(7)
    assert t.env == "rg:basic_arithmetic" and t.messages[-1].content.startswith("Calculate ")
    a, b, op = t.messages[-1].content[len("Calculate "):-1].split(" ")[::2] + [
        t.messages[-1].content.split(" ")[2]]
    truth = int(a) + int(b) if op == "+" else int(a) - int(b)  # independent of the verifier
    assert env.demonstration(t)[0].content == str(truth)
    assert env.respond(t, AssistantOutput(content=f" {truth}\n"), ()).reward == 1.0
    assert env.respond(t, AssistantOutput(content=str(truth + 1)), ()).reward == 0.0
    assert env.respond(t, AssistantOutput(content=""), ()).reward == 0.0
    # deterministic per (seed, split, index); held-out differs from train
    assert env.task(7).messages == make_env("rg:basic_arithmetic", seed=5, **ARITH).task(
        7).messages
    train = [env.task(i).messages for i in range(20)]
    held = [env.task(i, "heldout").messages for i in range(20)]
    assert train != held
    with pytest.raises(ValueError, match="split"):
        env.task(0, "test")


def test_reasoning_gym_rewrite_and_errors():
    env = make_env("rg:chain_sum", min_terms=2, max_terms=2, max_digits=1,
                   rewrite=["^State the final answer to the following arithmetic problem: ",
                            ""])
    t = env.task(0)
    assert t.messages[-1].content.endswith("=") and len(t.messages[-1].content) < 12
    assert env.respond(t, AssistantOutput(content=env.demonstration(t)[0].content),
                       ()).reward == 1.0
    with pytest.raises(ValueError, match="does not match"):
        make_env("rg:chain_sum", rewrite=["^Nothing like this", ""])
    with pytest.raises(ValueError, match="chain_sum.*bogus"):
        make_env("rg:chain_sum", bogus=1)
    with pytest.raises(ValueError, match="rewrite must be"):
        make_env("rg:chain_sum", rewrite="x")
    with pytest.raises(ValueError, match="size must be an integer in"):
        make_env("rg:chain_sum", size=2_000_000)  # train entry 1,000,003 = held-out entry 0


def test_stripes_always_show_both_colours():
    """image_stripes' smallest images (4 and 5 pixels) drew stripes up to 5 wide: one colour
    in about a fifth of them, with no right answer."""
    from kdsa.train.rl.envs.image_stripes import stripes

    rng = np.random.default_rng(0)
    for size in (4, 5, 6, 28):
        for _ in range(200):
            img = stripes(rng, bool(rng.integers(2)), size)
            assert len(np.unique(img)) == 2, size


def test_tool_use_protocol():
    env = ToolLookupEnv(seed=1)
    t = env.task(4)
    word, book = t.data
    assert word in t.messages[0].content and t.tools[0].name == "lookup"
    call = ToolCall("functions.lookup:0", "lookup", json.dumps({"word": word}))
    o1 = env.respond(t, AssistantOutput(tool_calls=(call,)), ())
    assert not o1.done and o1.messages[0].content == str(book[word])
    hist = (Message("assistant", tool_calls=(call,)),) + o1.messages
    done = env.respond(t, AssistantOutput(content=f"It is {book[word]}."), hist)
    assert done.done and done.reward == 1.0 and done.metrics["valid_call"] == 1.0
    # answering without the call, or with a wrong answer: 0
    assert env.respond(t, AssistantOutput(content=str(book[word])), ()).reward == 0.0
    assert env.respond(t, AssistantOutput(content=str(book[word] + 1)), hist).reward == 0.0
    # invalid calls get an error message naming the problem, and the episode goes on
    for bad, msg in ((ToolCall("c1", "lookup", "{word: 1"), "not valid JSON"),
                     (ToolCall("c1", "search", "{}"), "unknown tool"),
                     (ToolCall("c1", "lookup", '{"word": 3}'), "must be")):
        o = env.respond(t, AssistantOutput(tool_calls=(bad,)), ())
        assert not o.done and msg in o.messages[0].content
    # a call on the last allowed turn ends the episode with 0
    two = hist + (Message("assistant", "?"),)
    assert env.respond(t, AssistantOutput(tool_calls=(call,)), two).done
    # the code as a number of its own: inside a longer number it is no answer
    assert env.respond(t, AssistantOutput(content=f"{book[word]}3"), hist).reward == 0.0
    assert env.respond(t, AssistantOutput(content=f"19{book[word]}"), hist).reward == 0.0
    assert env.respond(t, AssistantOutput(content=f"code:{book[word]}."), hist).reward == 1.0
    with pytest.raises(ValueError, match="unknown options.*max_turn"):
        make_env("tool_lookup", max_turn=3)  # a TypeError (traceback) before
    with pytest.raises(ValueError, match=r"rl.envs\[0\].options: no 'seed' here"):
        RLConfig(envs=({"name": "tool_lookup", "options": {"seed": 3}},))  # a TypeError later


def _sublist_replaced(ids: list, old: list, new: list) -> list:
    k = next(k for k in range(len(ids)) if ids[k:k + len(old)] == old)
    return ids[:k] + new + ids[k + len(old):]


@pytest.mark.parametrize("fmt_name,edits", [
    ("k2", [('{"word": "cup"}', "{word: cup}")]),
    ("xtml", [('type="string"', 'type="object"'), ("cup", "{cup")])])
def test_a_tool_call_the_parser_drops_gets_an_error_and_the_episode_goes_on(fmt_name, edits):
    """Arguments that are not a JSON object make the chat format's parser drop the call
    (``AssistantOutput.errors``): the episode goes on with a user message carrying the parser's
    error (it ended as an answer with reward 0), and the next turn renders after it."""
    tok = ByteTokenizer(384, flavor="k2") if fmt_name == "k2" else ByteTokenizer(512)
    fmt = get_format(fmt_name, tok)
    env = ToolLookupEnv(seed=1)
    t = env.task(4)
    call = ToolCall("functions.lookup:0", "lookup", '{"word": "cup"}')
    base = fmt.render(list(t.messages), tools=list(t.tools))
    full = fmt.render(list(t.messages) + [Message("assistant", "", reasoning="",
                                                  tool_calls=(call,))],
                      tools=list(t.tools), add_generation_prompt=False)
    gen = full[len(base):]  # the assistant turn as the model would write it
    assert fmt.parse(gen, strict=False).tool_calls == (call,)
    for old, new in edits:
        gen = _sublist_replaced(gen, tok.encode(old), tok.encode(new))
    out = fmt.parse(gen, strict=False)
    assert not out.tool_calls and any(e.startswith("malformed tool call") for e in out.errors)
    o = env.respond(t, out, ())
    assert not o.done and [m.role for m in o.messages] == ["user"]
    assert o.messages[0].content.startswith("error: malformed tool call"), o.messages
    assert ro.continuation_ids(fmt, t, "high", [out.as_message()], list(o.messages))
    two = (Message("assistant", "?"), Message("assistant", "?"))
    assert env.respond(t, out, two).done  # on the last allowed turn: over, reward 0


class _ToolScriptRunner:
    """Writes K2 turns: first a lookup call for the word in the prompt, then the code that the
    tool returned (read from the prompt); forced tokens are followed like sampled ones."""

    def __init__(self, tok, fmt, num_slots=4, max_len=1024):
        self.tok, self.fmt = tok, fmt
        self.vocab_size, self.num_slots, self.max_len = tok.vocab_size, num_slots, max_len
        self.prefill_chunk, self.mesh = max_len, None
        self.seen = [[] for _ in range(num_slots)]
        self.plan = [[] for _ in range(num_slots)]

    def _script(self, ids):
        text = self.tok.decode(ids)
        if "## Return of" in text:
            code = text.rsplit("## Return of functions.lookup:0\n", 1)[1].split("<|")[0]
            return [self.tok.special("</think>")] + self.tok.encode(code) + [
                self.tok.special("<|im_end|>")]
        word = text.rsplit("What is the code of ", 1)[1].split("?")[0]
        call = ToolCall("functions.lookup:0", "lookup", json.dumps({"word": word}))
        full = self.fmt.render([Message("user", "x"), Message("assistant", "", reasoning="",
                                                               tool_calls=(call,))],
                               add_generation_prompt=False, effort="low")
        start = len(self.fmt.render([Message("user", "x")], effort="low"))
        return full[start:]

    def _logits(self, slot):
        out = np.zeros(self.vocab_size, np.float32)
        k = len(self.seen[slot]) - self.prompt_len[slot]
        plan = self.plan[slot]
        out[plan[k] if k < len(plan) else self.tok.special("<|im_end|>")] = 30.0
        return out

    def prefill(self, slot, tokens, start=0):
        if start == 0:
            self.seen[slot] = []
        self.seen[slot] += list(tokens)
        if not hasattr(self, "prompt_len"):
            self.prompt_len = [0] * self.num_slots
        self.prompt_len[slot] = len(self.seen[slot])
        self.plan[slot] = self._script(self.seen[slot])
        return self._logits(slot)[None]

    def decode(self, tokens, positions, active):
        rows = []
        for s in range(self.num_slots):
            if active[s]:
                self.seen[s].append(int(tokens[s]))
            rows.append(self._logits(s) if active[s] else np.zeros(self.vocab_size, np.float32))
        return np.stack(rows)


def test_tool_use_episode_through_the_engine(fmt):
    tok = fmt.tok
    env = ToolLookupEnv(seed=2)
    rc = RLConfig(envs=("tool_lookup",), seq_len=600, token_budgets={"low": 200, "high": 200,
                                                                     "max": 200},
                  reasoning_caps={"low": 0, "high": 8, "max": 8})
    engine = Engine(_ToolScriptRunner(tok, fmt), tok, chat_format=fmt,
                    budgets=BudgetConfig(caps=dict(rc.reasoning_caps), grace=0))
    tasks = [(env.task(i), "low") for i in range(2)]
    eps = ro.run_episodes(engine, fmt, {env.domain: env}, tasks, group_size=2, rc=rc, seed=0)
    assert len(eps) == 4
    for e in eps:
        assert e.done and not e.truncated and e.score == 1.0, (e.score, e.texts)
        assert [m.role for m in e.history] == ["assistant", "tool", "assistant"]
        # the row equals the demonstration rendered by the format; trained tokens = the two
        # assistant turns minus the forced end-of-thinking (low effort: cap 0 forces it)
        ids, mask = demonstration_row(fmt, e.task, env.demonstration(e.task), "low")
        assert e.tokens == ids
        trained = [t for t, m in zip(e.tokens, e.mask) if m]
        want = [t for t, m in zip(ids, mask) if m and t != tok.special("</think>")]
        assert trained == want
        assert all(lp == 0.0 for lp, m in zip(e.sampler_logp, e.mask) if not m)


def test_group_length_penalty_and_dynamic_sampling():
    rc = RLConfig(length_penalty={"low": 1.0, "high": 0.0, "max": 0.0})
    t = Task("d", 0, (Message("user", "q"),))

    def ep(score, n, effort="low"):
        return ro.Episode(t, effort, [0], [0.0], [0.0], 1, score=score, generated=n)

    g = [ep(1.0, 10), ep(0.0, 20), ep(1.0, 10), ep(0.0, 30)]  # min 10, max 30
    ro.group_rewards(g, 4, rc)
    # lambda = 0.5 - (n - 10) / 20: 0.5, 0, 0.5, -0.5; correct +lambda, wrong min(0, lambda)
    assert [e.reward for e in g] == [1.5, 0.0, 1.5, -0.5]
    h = [ep(1.0, 5, "high"), ep(0.0, 9, "high")]  # weight 0 at high: no length term
    ro.group_rewards(h, 2, rc)
    assert [e.reward for e in h] == [1.0, 0.0]
    same = [ep(0.0, 4), ep(0.0, 4)]
    lens = [ep(0.0, 4), ep(0.0, 8)]  # rewards differ by the length term only
    ro.group_rewards(same, 2, rc)
    ro.group_rewards(lens, 2, rc)
    assert lens[0].reward != lens[1].reward
    kept = ro.varied_groups(g + same + lens, 2)
    assert kept == [g[:2], g[2:]]  # `same` and `lens` have constant scores: dropped
    b = ro.training_batch(kept, 6, 4, 2, rc)
    adv = b["advantages"]
    np.testing.assert_allclose(adv[:4], [1, -1, 1, -1], atol=1e-5)  # GRPO, 2 per group
    assert np.all(adv[4:] == 0) and np.all(b["loss_mask"][4:] == 0)
    # dynamic sampling off: a group that differs by the length term alone keeps r - mean (its
    # differences std-normalised became full-size pushes toward shorter answers)
    b = ro.training_batch([g[:2], lens], 4, 4, 2, rc)
    np.testing.assert_allclose(b["advantages"], [1, -1, 0.25, -0.25], atol=1e-5)


def test_sft_batch_masks_assistant_tokens(fmt):
    env = make_env("rg:basic_arithmetic", **ARITH)
    tasks = [(env.task(i), "high") for i in range(3)]
    b = sft_batch(fmt, {env.domain: env}, tasks, 4, 80)
    tok = fmt.tok
    for r, (t, _) in enumerate(tasks):
        got = [int(x) for x, m in zip(b["targets"][r], b["loss_mask"][r]) if m]
        assert got == [tok.special("</think>")] + tok.encode(
            env.demonstration(t)[0].content) + [tok.special("<|im_end|>")]
    assert b["loss_mask"][3].sum() == 0
    with pytest.raises(ValueError, match="rl.seq_len=8"):
        sft_batch(fmt, {env.domain: env}, tasks, 3, 8)


def test_config_errors():
    with pytest.raises(ValueError, match="rl.group_size"):
        RLConfig(group_size=1)
    with pytest.raises(ValueError, match="rl.token_budgets"):
        RLConfig(token_budgets={"low": 1})
    with pytest.raises(ValueError, match="rl.envs\\[0\\].weight"):
        RLConfig(envs=({"name": "x", "weight": -1},))
    with pytest.raises(ValueError, match="unknown RL config field"):
        apply_rl_overrides(RLConfig(), ["nope=1"])
    rc = apply_rl_overrides(RLConfig(), ['envs=[{"name": "rg:chain_sum", "weight": 2}]',
                                         "loss=dapo"])
    assert rc.envs[0].weight == 2.0 and rc.loss_config().aggregation == "token"


def test_prompts_that_fill_seq_len_are_refused_or_named(fmt):
    """tool_lookup's prompts (about 300 byte tokens) under the default rl.seq_len=96: every
    episode was cut before its first token and nothing trained, without an error; now refused
    before anything compiles. Where some sampled prompts fit and some do not, a warning."""
    from kdsa.model.config import get_preset
    from kdsa.train.config import TrainConfig
    from kdsa.train.rl.preflight import PROMPT_SAMPLES, check_rl_configs

    cfg, tc = get_preset("tiny"), TrainConfig()
    with pytest.raises(ValueError, match="rl.seq_len=96 leaves no room to answer 'tool_lookup'"):
        check_rl_configs(cfg, tc, RLConfig(envs=("tool_lookup",)))
    arith = RLConfig(envs=({"name": "rg:basic_arithmetic", "options": ARITH},),
                     effort_weights={"low": 1.0, "high": 0.0, "max": 0.0}, chat_format="k2")
    env = make_env("rg:basic_arithmetic", seed=0, **ARITH)
    lengths = sorted(len(ro.render_prompt(fmt, env.task(i), "low"))
                     for i in range(PROMPT_SAMPLES))
    assert lengths[0] < lengths[-1]
    said = []
    check_rl_configs(cfg, tc, arith.replace(seq_len=lengths[-1]), log=said.append)
    assert len(said) == 1 and "of the first 16 prompts of 'rg:basic_arithmetic'" in said[0]
    check_rl_configs(cfg, tc, arith.replace(seq_len=lengths[-1] + 1), log=said.append)
    assert len(said) == 1


def test_cli_config_errors_exit_2(tmp_path, capsys):
    from kdsa.cli.main import main

    for argv, msg in ((["--rl-set", "loss=foo"], "rl.loss"),
                      (["--rl-set", 'envs=["nope"]'], "unknown environment"),
                      (["--rl-set", "seq_len=0"], "rl.seq_len must be a positive integer"),
                      # a RoPE model's positions end at max_position_embeddings (NoPE: no limit)
                      (["--set", "mla_use_nope=false", "--rl-set", "seq_len=4096"],
                       "max_position_embeddings")):
        assert main(["rl", "--run-dir", str(tmp_path), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0]
    assert not any(tmp_path.iterdir())  # nothing written, nothing built


def test_reward_curve_figure(tmp_path):
    """A PNG of the expected size with a line per environment (matplotlib colours C0, C1), the
    mean in black and the held-out lines; mismatched inputs are refused."""
    from PIL import Image

    steps = list(range(1, 21))
    metrics = [{"score/a": s / 20, "score/b": 1 - s / 20, "score": 0.5,
                "effort_score/low": 0.3, "effort_score/high": 0.6} for s in steps]
    p = reward_curve(tmp_path / "c.png", steps, metrics, envs=["a", "b"],
                     efforts=["low", "high"], heldout_before=0.25, heldout_after=0.75)
    img = np.asarray(Image.open(p).convert("RGB")).astype(int)
    assert img.shape == (420, 1100, 3)

    def share(rgb):  # fraction of pixels within a small distance of a colour
        return float((np.abs(img - np.array(rgb)).sum(-1) < 40).mean())

    for rgb in ((31, 119, 180), (255, 127, 14), (0, 0, 0)):  # C0, C1, the mean
        assert share(rgb) > 1e-3, rgb
    with pytest.raises(ValueError, match="3 steps but 2 metric rows"):
        reward_curve(tmp_path / "d.png", [1, 2, 3], metrics[:2], envs=["a"], efforts=[])


def test_demo_environments_build_and_score_their_references():
    """The demo's families build with their rewrites, give short questions, and score their own
    reference answers 1 (so SFT demonstrations and the verifier agree)."""
    from kdsa.train.rl.demo import demo_configs

    _, _, rc = demo_configs()
    assert len(rc.envs) >= 3
    for spec in rc.envs:
        env = make_env(spec.name, seed=0, **spec.options)
        for i in range(8):
            task = env.task(i, "heldout")
            assert len(task.messages[-1].content) < 40, task.messages[-1].content
            ref = env.demonstration(task)[-1].content
            out = env.respond(task, AssistantOutput(content=ref), [])
            assert out.reward == 1.0, (spec.name, task.messages[-1].content, ref)
