"""The public name of the rule engine: ``eventpush.patterns.compile_pattern``, ``RuleIndex`` and
``InvalidPatternError`` are a contract for scripts; the code lives in ``eventpush.rules``."""

from eventpush.rules.patterns import InvalidPatternError, RuleIndex, compile_pattern

__all__ = ["InvalidPatternError", "RuleIndex", "compile_pattern"]
