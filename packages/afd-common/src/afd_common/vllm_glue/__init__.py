"""Where afd meets vLLM: the plugin entry point, every patch of vLLM (one place, version-guarded,
undoable), the role's lifecycle and status, and what afd reads off vLLM's model and config."""
