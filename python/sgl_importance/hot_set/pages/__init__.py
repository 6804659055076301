"""A long request's pages: where each lives and how it moves.

``state.py`` holds the page-state table of one request (``RequestPages``: a ``PageState`` per
page, its device and host slots) and the moves a step asks for (``PageMoves``);
``copies.py`` runs the copies between the device and host pools (a side stream on CUDA);
``prefix_hold.py`` is a radix-tree prefix a request reads from the host;
``host_ledger.py`` checks who holds each host slot; ``rows.py`` lends KV pages to the
hot set's summary rows; ``footprint.py`` is the arithmetic of a request's device bytes.
The owner that applies the moves is ``hot_set/residency.py``.
"""
