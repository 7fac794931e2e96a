# onlinespec serve in a container, built with the same commands CI runs (`make setup`):
#   docker build -t onlinespec .
#   docker run -p 8000:8000 onlinespec                     # the packaged default target
#   docker run -p 8000:8000 -v /models:/models onlinespec /models/my.gguf --served-model-name my-model
FROM python:3.11-slim

# a C++ toolchain: llama-cpp-python builds llama.cpp from source (about 5 minutes on 2 cores)
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake make git \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/onlinespec
COPY . .
RUN make setup PYTHON=python3 && rm -rf /root/.cache/pip

ENV PATH=/opt/onlinespec/.venv/bin:$PATH \
    ONLINESPEC_CACHE=/var/cache/onlinespec
# convert the packaged target and unpack the data once, at build time, not at every start
RUN python -c "from onlinespec.models import default_target_dir; default_target_dir()"

EXPOSE 8000
ENTRYPOINT ["onlinespec", "serve", "--host", "0.0.0.0", "--port", "8000"]
