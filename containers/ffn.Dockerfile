# The FFN role alone: afd-ffn + afd-common + vLLM (CPU build shown; use [cuda] on GPUs).
# Build the wheels first from the workspace root:  uv build --all-packages -o dist
#   docker build -f containers/ffn.Dockerfile -t afd-ffn .
FROM python:3.11-slim
COPY dist/afd_common-*.whl dist/afd_ffn-*.whl /wheels/
RUN pip install --no-cache-dir torch==2.13.0 torchvision==0.28.0 \
 && pip install --no-cache-dir /wheels/afd_common-*.whl "$(ls /wheels/afd_ffn-*.whl)[cpu]" \
      torch==2.13.0 torchvision==0.28.0
ENV VLLM_USE_V2_MODEL_RUNNER=0
# The rendezvous port (the FFN rank 0 hosts it) and the HTTP port.
EXPOSE 29600 8000
# Example: docker run afd-ffn vllm serve /models/m --additional-config \
#   '{"afd": {"role": "ffn", "host": "0.0.0.0", "port": 29600}}'
ENTRYPOINT ["vllm"]
