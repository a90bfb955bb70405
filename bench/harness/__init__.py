"""What every benchmark and device check shares: the SGLang server process (``servers``), the HTTP
client (``client``), the comparison with the exact reference server (``oracle``), the models they
make (``models``) and the result file (``results``). The entry points are the scripts in ``bench/``;
``tools/gpu/`` holds only what runs them on the GPU node."""
