"""Keyrings for the tests: `memory_keyring` (passwords in a dict, installed as the keyring for
one test) and `no_keyring` (keyring's failing backend: a machine without any). Registered as a
plugin in tests/conftest.py."""

from __future__ import annotations

import keyring
import keyring.backends.fail
import keyring.errors
import pytest
from keyring.backend import KeyringBackend


class MemoryKeyring(KeyringBackend):
    """A keyring in a dict."""

    priority = 1

    def __init__(self):
        super().__init__()
        self.passwords: dict[tuple[str, str], str] = {}

    def get_password(self, service, username):
        return self.passwords.get((service, username))

    def set_password(self, service, username, password):
        self.passwords[(service, username)] = password

    def delete_password(self, service, username):
        if self.passwords.pop((service, username), None) is None:
            raise keyring.errors.PasswordDeleteError(username)


def _installed(ring):
    previous = keyring.get_keyring()
    keyring.set_keyring(ring)
    try:
        yield ring
    finally:
        keyring.set_keyring(previous)


@pytest.fixture
def memory_keyring():
    yield from _installed(MemoryKeyring())


@pytest.fixture
def no_keyring():
    yield from _installed(keyring.backends.fail.Keyring())
