# Convenience aliases for the README commands (make is optional: scripts/run.sh is the real entry point).
.PHONY: test demo setup
setup: ; bash scripts/run.sh setup
test: ; bash scripts/run.sh test
demo: ; bash scripts/run.sh demo
