import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from zoo_gym.proto import signing

SHA = "ab" * 32


def _msg(**over):
    args = dict(method="SubmitDelta", contributor="0" * 32, round_id=3, payload_sha256=SHA, nonce=b"\x01" * 16,
                base_sha256="cd" * 32)
    args.update(over)
    return signing.canonical_bytes(**args)


def test_signature_binds_every_field():
    key = Ed25519PrivateKey.generate()
    pub = signing.public_bytes(key)
    sig = signing.sign(key, _msg())
    signing.verify(pub, sig, _msg())  # the genuine request verifies
    for change in (dict(method="Register"), dict(contributor="1" * 32), dict(round_id=4),
                   dict(payload_sha256="ac" * 32), dict(nonce=b"\x02" * 16), dict(base_sha256="ce" * 32)):
        with pytest.raises(signing.SignatureError):
            signing.verify(pub, sig, _msg(**change))


@pytest.mark.parametrize("bad", [dict(contributor="x\n" * 16), dict(payload_sha256="AB" * 32),
                                 dict(nonce=b"short"), dict(method="Delete"), dict(round_id=-1)])
def test_malformed_fields_are_refused(bad):
    with pytest.raises(signing.SignatureError):
        _msg(**bad)


def test_key_file_is_created_private_and_reloaded(tmp_path):
    path = tmp_path / "keys" / "contributor.pem"
    key, created = signing.load_or_create_key(path)
    assert created and (path.stat().st_mode & 0o777) == 0o600
    again, created_again = signing.load_or_create_key(path)
    assert not created_again and signing.public_bytes(again) == signing.public_bytes(key)
    path.write_text("not a key")
    with pytest.raises(signing.SignatureError, match="not an unencrypted PEM"):
        signing.load_or_create_key(path)
