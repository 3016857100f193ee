"""Rules: EventBridge event patterns and the input transforms.

The pattern engine is a compiler apart from its evaluator: ``parse`` validates a pattern into
its parsed form, ``match`` compiles that into closures (``CompiledPattern``), ``index`` files
many rules' conditions in per-field tables (``RuleIndex``); ``patterns`` is their public face
(the language's description and the names scripts import). ``transforms`` holds the input
transforms."""
