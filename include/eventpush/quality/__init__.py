"""Great Expectations checks: the batch jobs' suites (``batch``) and the push slice's
(``push_slice``); every result is recorded in ``event_check_result``."""
