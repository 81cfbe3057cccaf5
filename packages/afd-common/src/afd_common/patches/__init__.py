"""afd_common's changes to vLLM, installed by the plugin entry point in every vLLM process.

* ``vllm_config``: choose the role's worker when ``worker_cls`` is ``auto``, validate the ``afd``
  section as soon as vLLM builds its config, and switch off what a role cannot use.
* ``api_server``: the FFN role's HTTP front end refuses generation requests and answers
  ``/health`` from the FFN loop's state.
"""
