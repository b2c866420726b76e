"""The composition root: the `splitserve` command and the local launcher, the only code that imports
every role."""
