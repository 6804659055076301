"""Helpers the test modules share, importable as ``support.<module>``.

``pytest.ini`` puts ``test/`` on the import path and imports test modules with
``--import-mode=importlib``, so test modules never import each other or a
``conftest`` by name; what two modules share lives here.
"""
