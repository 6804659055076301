"""What a step reads: each request's selection and the step's page lists.

``selection.py`` is the policy (sinks, window and the pages it keeps, by importance);
``sample.py`` the page sample the guard estimates from; ``request_state.py`` what the
selection tracks per request across steps; ``page_lists.py`` turns a step's plans into
the kernels' lists; ``step_tally.py`` gathers what the layers found, folded once a step.
"""
