"""afd_ffn's changes to vLLM. Each module builds one ``afd_common.vllm_glue.patching.PatchSet``."""
