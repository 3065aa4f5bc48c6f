"""The composition fuzzer: generated models and layouts, each compared with the same model on one process.

``cases.py`` draws a model (:class:`ModelSpec`, built from the library's layers) and a layout
(:class:`LayoutSpec`, from the composition matrix) from one seed; ``harness.py`` trains the model serially
and under the layout and compares loss, clip norm, every parameter and the state dict round trip (a
checkpoint saved under one layout, restored under another); ``run.py`` runs many seeds under ``mpiexec``
and shrinks a failure to the smallest model and layout that still fail.  ``tests/test_fuzz.py`` runs a fixed
set of seeds in ``make test``; ``make fuzz N=500`` runs more (docs/parallelize.md, "The fuzzer").
"""
