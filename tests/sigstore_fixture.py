"""A private Sigstore instance, made on the spot, for signature tests without a network.

It plays the three public services a real bundle depends on, each with its own fresh key:
a Fulcio-like CA that issues a short-lived signing certificate carrying GitHub Actions' OIDC
claims (issuer, source repository, build-signer workflow), a certificate-transparency log whose
SCT is embedded in that certificate, and a Rekor-like transparency log holding the signature in
a one-entry tree (inclusion proof, signed checkpoint, signed entry timestamp). `trusted_root`
writes the trust root naming those keys, in Sigstore's trusted_root.json format, and `sign`
returns a Sigstore bundle (v0.3 JSON) over the given bytes, as kernel-builder's CI writes
`metadata.json.sigstore`. Nothing here verifies: the tests hand the results to sigstore-python.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import struct
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID, ObjectIdentifier

GITHUB_ISSUER = "https://token.actions.githubusercontent.com"
# Fulcio's OIDC claim extensions (1.3.6.1.4.1.57264.1.*) and the CT SCT-list extension.
_OID_ISSUER_V1 = ObjectIdentifier("1.3.6.1.4.1.57264.1.1")
_OID_ISSUER_V2 = ObjectIdentifier("1.3.6.1.4.1.57264.1.8")
_OID_BUILD_SIGNER_URI = ObjectIdentifier("1.3.6.1.4.1.57264.1.9")
_OID_SOURCE_REPO_URI = ObjectIdentifier("1.3.6.1.4.1.57264.1.12")
_OID_SCT_LIST = ObjectIdentifier("1.3.6.1.4.1.11129.2.4.2")
_NO_USAGE = dict(
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    encipher_only=False,
    decipher_only=False,
)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _der_length(n: int) -> bytes:
    if n < 128:
        return bytes([n])
    body = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([0x80 | len(body)]) + body


def _utf8_string(text: str) -> bytes:
    data = text.encode()
    return b"\x0c" + _der_length(len(data)) + data


def _spki(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


class TestSigstore:
    """Fresh CA, CT log and transparency log keys; see the module docstring."""

    __test__ = False  # not a pytest test class

    def __init__(self) -> None:
        self.now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
        self.ca_key = ec.generate_private_key(ec.SECP384R1())
        self.ct_key = ec.generate_private_key(ec.SECP256R1())
        self.log_key = ec.generate_private_key(ec.SECP256R1())
        self.ca_name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kernels-test"),
                x509.NameAttribute(NameOID.COMMON_NAME, "kernels-test-fulcio"),
            ]
        )
        self.ca = (
            x509.CertificateBuilder()
            .subject_name(self.ca_name)
            .issuer_name(self.ca_name)
            .public_key(self.ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self.now - datetime.timedelta(days=1))
            .not_valid_after(self.now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=1), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False, key_cert_sign=True, crl_sign=True, **_NO_USAGE
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self.ca_key.public_key()),
                critical=False,
            )
            .sign(self.ca_key, hashes.SHA384())
        )
        self.ct_log_id = hashlib.sha256(_spki(self.ct_key)).digest()
        self.log_id = hashlib.sha256(_spki(self.log_key)).digest()

    # -- the trust root ---------------------------------------------------------------------

    def trusted_root(self, path: Path) -> Path:
        """Write trusted_root.json naming this instance's CA, CT log and transparency log."""
        valid = {"start": (self.now - datetime.timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%SZ")}

        def key(k: ec.EllipticCurvePrivateKey) -> dict:
            return {
                "rawBytes": _b64(_spki(k)),
                "keyDetails": "PKIX_ECDSA_P256_SHA_256",
                "validFor": valid,
            }

        root = {
            "mediaType": "application/vnd.dev.sigstore.trustedroot+json;version=0.1",
            "tlogs": [
                {
                    "baseUrl": "https://rekor.kernels.test",
                    "hashAlgorithm": "SHA2_256",
                    "publicKey": key(self.log_key),
                    "logId": {"keyId": _b64(self.log_id)},
                }
            ],
            "certificateAuthorities": [
                {
                    "subject": {
                        "organization": "kernels-test",
                        "commonName": "kernels-test-fulcio",
                    },
                    "uri": "https://fulcio.kernels.test",
                    "certChain": {
                        "certificates": [
                            {"rawBytes": _b64(self.ca.public_bytes(serialization.Encoding.DER))}
                        ]
                    },
                    "validFor": valid,
                }
            ],
            "ctlogs": [
                {
                    "baseUrl": "https://ctfe.kernels.test",
                    "hashAlgorithm": "SHA2_256",
                    "publicKey": key(self.ct_key),
                    "logId": {"keyId": _b64(self.ct_log_id)},
                }
            ],
            "timestampAuthorities": [],
        }
        path.write_text(json.dumps(root))
        return path

    # -- signing ----------------------------------------------------------------------------

    def _certificate(
        self, key: ec.EllipticCurvePrivateKey, repo: str, signer_uri: str
    ) -> x509.Certificate:
        """A Fulcio-style leaf for a GitHub Actions workflow of `repo`, with an embedded SCT."""
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([]))
            .issuer_name(self.ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self.now - datetime.timedelta(minutes=1))
            .not_valid_after(self.now + datetime.timedelta(minutes=10))
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, key_cert_sign=False, crl_sign=False, **_NO_USAGE
                ),
                critical=True,
            )
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), critical=False
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.ca_key.public_key()),
                critical=False,
            )
            .add_extension(
                x509.SubjectAlternativeName([x509.UniformResourceIdentifier(signer_uri)]),
                critical=True,
            )
            .add_extension(
                x509.UnrecognizedExtension(_OID_ISSUER_V1, GITHUB_ISSUER.encode()), critical=False
            )
            .add_extension(
                x509.UnrecognizedExtension(_OID_ISSUER_V2, _utf8_string(GITHUB_ISSUER)),
                critical=False,
            )
            .add_extension(
                x509.UnrecognizedExtension(
                    _OID_SOURCE_REPO_URI, _utf8_string(f"https://github.com/{repo}")
                ),
                critical=False,
            )
            .add_extension(
                x509.UnrecognizedExtension(_OID_BUILD_SIGNER_URI, _utf8_string(signer_uri)),
                critical=False,
            )
        )
        # RFC 6962 precertificate SCT: the CT log signs the TBSCertificate without the SCT list
        # (what `tbs_precertificate_bytes` gives back for the final certificate) and the hash
        # of the issuer's key. cryptography cannot build SCTs, so the TLS structures are packed
        # here.
        tbs = builder.sign(self.ca_key, hashes.SHA256()).tbs_certificate_bytes
        millis = int(self.now.timestamp() * 1000)
        issuer_key_hash = hashlib.sha256(_spki(self.ca_key)).digest()
        signed = (
            struct.pack("!BBQH", 0, 0, millis, 1)  # v1, certificate_timestamp, time, precert
            + issuer_key_hash
            + len(tbs).to_bytes(3, "big")
            + tbs
            + b"\x00\x00"  # no extensions
        )
        sig = self.ct_key.sign(signed, ec.ECDSA(hashes.SHA256()))
        sct = (
            bytes([0])
            + self.ct_log_id
            + struct.pack("!QH", millis, 0)
            + bytes([4, 3])  # sha256, ecdsa
            + struct.pack("!H", len(sig))
            + sig
        )
        sct_list = struct.pack("!HH", len(sct) + 2, len(sct)) + sct
        value = b"\x04" + _der_length(len(sct_list)) + sct_list  # DER OCTET STRING
        cert = builder.add_extension(
            x509.UnrecognizedExtension(_OID_SCT_LIST, value), critical=False
        ).sign(self.ca_key, hashes.SHA256())
        assert cert.tbs_precertificate_bytes == tbs
        return cert

    def sign(
        self,
        data: bytes,
        *,
        repo: str = "huggingface/kernels-community",
        workflow: str = ".github/workflows/build.yaml@refs/heads/main",
    ) -> str:
        """A Sigstore bundle (JSON) over `data`, signed as the GitHub workflow `workflow` of
        `repo` and entered in this instance's transparency log."""
        import rfc8785
        from sigstore._internal.rekor import _hashedrekord_from_parts
        from sigstore.hashes import Hashed
        from sigstore_models.common.v1 import HashAlgorithm

        key = ec.generate_private_key(ec.SECP256R1())
        cert = self._certificate(key, repo, f"https://github.com/{repo}/{workflow}")
        digest = hashlib.sha256(data).digest()
        signature = key.sign(data, ec.ECDSA(hashes.SHA256()))
        entry = _hashedrekord_from_parts(
            cert, signature, Hashed(algorithm=HashAlgorithm.SHA2_256, digest=digest)
        )
        body = rfc8785.dumps(entry.model_dump(mode="json", by_alias=True, exclude_none=True))
        # A one-entry tree: the root is the leaf hash and the inclusion proof is empty.
        root = hashlib.sha256(b"\x00" + body).digest()
        integrated = int(self.now.timestamp())
        note = f"rekor.kernels.test - 1\n1\n{_b64(root)}\n"
        note_sig = self.log_key.sign(note.encode(), ec.ECDSA(hashes.SHA256()))
        checkpoint = f"{note}\n\u2014 rekor.kernels.test {_b64(self.log_id[:4] + note_sig)}\n"
        promise = rfc8785.dumps(
            {
                "body": _b64(body),
                "integratedTime": integrated,
                "logID": self.log_id.hex(),
                "logIndex": 0,
            }
        )
        promise_sig = self.log_key.sign(promise, ec.ECDSA(hashes.SHA256()))
        bundle = {
            "mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json",
            "verificationMaterial": {
                "certificate": {"rawBytes": _b64(cert.public_bytes(serialization.Encoding.DER))},
                "tlogEntries": [
                    {
                        "logIndex": "0",
                        "logId": {"keyId": _b64(self.log_id)},
                        "kindVersion": {"kind": "hashedrekord", "version": "0.0.1"},
                        "integratedTime": str(integrated),
                        "inclusionPromise": {"signedEntryTimestamp": _b64(promise_sig)},
                        "inclusionProof": {
                            "logIndex": "0",
                            "rootHash": _b64(root),
                            "treeSize": "1",
                            "hashes": [],
                            "checkpoint": {"envelope": checkpoint},
                        },
                        "canonicalizedBody": _b64(body),
                    }
                ],
            },
            "messageSignature": {
                "messageDigest": {"algorithm": "SHA2_256", "digest": _b64(digest)},
                "signature": _b64(signature),
            },
        }
        return json.dumps(bundle)


def sign_variant(
    sigstore: TestSigstore, files: dict[str, str | bytes], variant: str = "torch-universal", **kw
) -> dict[str, bytes]:
    """`files` (repo paths, as GitRepoWriter.commit takes them) with `build/<variant>/
    metadata.json` given the sha256 digest of the variant's other files, as kernel-builder writes
    it, and signed by `sigstore` (`metadata.json.sigstore` added; `kw` go to `sign`)."""
    base = f"build/{variant}/"
    raw = {p: d.encode() if isinstance(d, str) else d for p, d in files.items()}
    meta = json.loads(raw[f"{base}metadata.json"])
    meta["digest"] = {
        "algorithm": "sha256",
        "files": {
            p[len(base) :]: _b64(hashlib.sha256(d).digest())
            for p, d in sorted(raw.items())
            if p.startswith(base) and p != f"{base}metadata.json"
        },
    }
    data = json.dumps(meta).encode()
    raw[f"{base}metadata.json"] = data
    raw[f"{base}metadata.json.sigstore"] = sigstore.sign(data, **kw).encode()
    return raw
