"""afd_attention's changes to vLLM. Each module builds one ``afd_common.patching.PatchSet``."""
