"""megatron-core backend for large models on GPU: tensor (TP), pipeline (PP) and context (CP)
parallel training, data parallel over the remaining ranks. docs/megatron.md has the details.

Verified here, on CPU (tests/test_megatron_convert.py, test_megatron_publish.py, and with
megatron-core 0.16.1 in its own venv test_megatron_core.py):

* `convert.py`: HF ⇄ Megatron state dicts for the Qwen2 and Llama families (per-group QKV fusing,
  `[gate; up]` fc1, tied or untied embeddings, q/k/v biases, padded vocabularies); a tiny Qwen2 and
  a tiny Llama round-trip byte-exact through TP 1 and TP 2 shards;
* `shard.py`: TP sharding and unsharding of every parameter, and the gather of TP shards to an HF
  state dict on rank 0 (gloo); `publish.py` publishes it through `weights/`, byte for byte what
  the HF trainer publishes;
* `reference.py`: the Megatron-layout shards (TP 1 and 2) compute the HF model's logits;
* `gpt.py`: megatron-core's GPTModel (local spec) is built on CPU at TP 1 and TP 2 (2 gloo ranks)
  and the converted state dicts fit it key for key and shape for shape; the TP 2 models' own
  state dicts gather back to the HF checkpoint byte for byte;
* `checks.py`: the layout constraints, checked at `prepare`.

Not verified (needs CUDA): the GPTModel forward. It stops at its first CUDA call,
megatron/core/models/common/embeddings/rotary_pos_embedding.py:162 (`RotaryEmbedding.get_emb`
moves `inv_freq` to `torch.cuda.current_device()`: "Torch not compiled with CUDA enabled"), so
logits vs HF, TP 2 = TP 1 through megatron-core, the loss under PP, CP and fused kernels are for a
GPU run. `selfcheck.py` is the runnable check (`python -m areal_core.megatron.selfcheck`).

`shapes.py`, `convert.py`, `shard.py`, `reference.py` and `gpt.py` import only torch (and
megatron-core in `gpt.py`), so they run in the megatron venv; `checks.py` and `publish.py` need
the project's venv.
"""
