"""One module per CLI verb: ``add_arguments(parser)`` and ``run(args) -> int``.

A verb imports at its top what imports without torch; what would bring torch in (the training code,
the measuring code) it imports inside the function that runs it, with a comment saying so, so that
building one verb's parser (``seqpar`` builds only the named verb's), its ``--help`` and the
analytic verbs (``plan``, ``paper``) do not load torch (``tests/test_cli_imports.py``; eval and
bench import torch at their top).
"""
