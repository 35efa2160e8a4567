#!/usr/bin/env bash
# On the GPU machine: install vLLM into /tmp/vsite from the parts carried to /tmp/vparts
# (../shared/gpu/fetch-vllm-peer.sh, one part per call), once. Sourced or run; never fails the
# caller: without vLLM the vLLM stages are skipped.
if [ ! -d /tmp/vsite ] && compgen -G "/tmp/vparts/part.*" > /dev/null; then
  echo "assembling vLLM from /tmp/vparts ..."
  (cd /tmp && cat vparts/part.* > vbundle.tar && tar xf vbundle.tar \
     && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite vbundle/*.whl \
     && rm -f vbundle.tar) || echo "vLLM install failed: vLLM stages will be skipped"
fi
