"""llm_bridge against aggregation's exact dynamic programme (TabularLM teachers), and its code paths
on tiny randomly initialised Llama / Qwen2 models built from a config (no download)."""

import numpy as np
import pytest
import torch

import aggregation as ag
from aggregation import examples
from llm_bridge.tabular import TabularLM
from llm_bridge.teachers import Teacher, Teachers, check_tokenizers, resolve_device

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
    np.testing.assert_allclose(full[1], ref.double().numpy(), atol=1e-6)
    np.testing.assert_allclose(path[1], ref[torch.arange(len(cont)), cont].double().numpy(), atol=1e-6)
    np.testing.assert_allclose(np.exp(full).sum(-1), 1.0, atol=1e-5)
    unchunked = bridge.teacher_log_probs(prompt, cont, full=True, chunk=512)
    np.testing.assert_allclose(unchunked[1], full, atol=1e-7)
    res = bridge.path_analysis(prompt, cont)
    np.testing.assert_allclose(np.exp(res["local_geometric"]).sum(-1), 1.0, atol=1e-9)


class FakeTokenizer:
    def __init__(self, vocab, eos=0):
        self.vocab, self.eos_token_id = vocab, eos
        self.bos_token_id = self.pad_token_id = self.unk_token_id = None

    def get_vocab(self):
        return dict(self.vocab)


def test_tokenizer_differences_are_named():
    a = FakeTokenizer({"a": 0, "b": 1, "c": 2})
    check_tokenizers([a, FakeTokenizer({"a": 0, "b": 1, "c": 2})])
    with pytest.raises(ValueError, match=r"tokenizer 1 maps 'b' to id 2, tokenizer 0 to 1"):
        check_tokenizers([a, FakeTokenizer({"a": 0, "c": 1, "b": 2})])
    with pytest.raises(ValueError, match="tokenizer 1 has 2 tokens"):
        check_tokenizers([a, FakeTokenizer({"a": 0, "b": 1})])
    with pytest.raises(ValueError, match="tokenizer 1 has eos_token_id = 2"):
        check_tokenizers([a, FakeTokenizer({"a": 0, "b": 1, "c": 2}, eos=2)])


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
    model = tiny_llama()
    cpu = Teachers([Teacher(model)], [1.0], 64).teacher_log_probs([1, 2], [3, 4, 5], full=True)
    gpu = Teachers([Teacher(tiny_llama())], [1.0], 64, device="cuda").teacher_log_probs([1, 2], [3, 4, 5], full=True)
    np.testing.assert_allclose(gpu[1], cpu[1], atol=1e-4)
