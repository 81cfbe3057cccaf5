"""afd_common's changes to vLLM (README "What afd changes in vLLM" lists every symbol).

Installed by the plugin entry point in every vLLM process:

* ``vllm_config``: choose the role's worker when ``worker_cls`` is ``auto``, validate the ``afd``
  section as soon as vLLM builds its config, and switch off what a role cannot use.
* ``api_server``: ``/metrics`` with the AFD series, ``/health`` from the roles' status files,
  the FFN role's refusal of generation requests.

Installed by either role's worker around model construction:

* ``moe_parallel``: the MoE layers' parallelism is AFD's, not vLLM's DP/TP fold.
* ``weight_census``: what the role loaded, counted before vLLM repacks it.
"""
