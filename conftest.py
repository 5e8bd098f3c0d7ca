"""Collection settings for the doctest run over src/.

``dmscale/export/hf_remote`` holds modeling files that are copied next to saved checkpoints and run
without dmscale; importing them needs a working ``import transformers``, which on machines with
a CPU-only torch and a CUDA torchvision build only dmscale's own import fix provides. They are
tested by loading saved checkpoints (tests/export/test_hf_export.py), not by import at collection.

``tests/*_fresh.py`` are scripts the tests run in a fresh process that blocks ``import dmscale``;
imported by the doctest collection they would install that block in the test process itself.
``tests/integrations/*_script.py`` and ``tests/tasks/*_script.py`` are run under torchrun by the tests.
``tests/doc_preludes/*.py`` are hidden setups that tests/test_doc_blocks.py runs before
documentation code blocks; imported on their own they would build models or join a process group.
"""

collect_ignore_glob = ["src/dmscale/export/hf_remote/*", "tests/*_fresh.py", "tests/integrations/*_script.py",
                       "tests/tasks/*_script.py", "tests/doc_preludes/*"]
