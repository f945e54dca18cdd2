"""One module per CLI verb: ``add_arguments(parser)`` and ``run(args) -> int``.

A verb imports what it runs inside its functions, so that building one verb's parser (``seqpar`` builds only the
named verb's), its ``--help`` and the analytic verbs (``plan``, ``paper``: ``tests/test_cli_imports.py``) do not
load torch or the training code: that is the reason for the imports inside functions here.
"""
