//! Standard base64 (RFC 4648 §4), the encoding of a `GEN`'s pictures and of the APIs' image data. Both
//! sides use it: the server checks a picture before it takes the engine, the engine decodes it. Written
//! here rather than taken from a crate: thirty lines, and the protocol crate depends on serde alone.

/// The alphabet, by value.
const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// `bytes` as base64 with padding.
pub fn encode_base64(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The bytes of base64 text: ASCII white space is skipped (some clients wrap long lines), padding is
/// optional; any other character outside the alphabet, padding before the end, or a length no encoder
/// writes is an error that says where.
pub fn decode_base64(text: &str) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    let (mut acc, mut n, mut padding) = (0u32, 0usize, 0usize);
    for (i, c) in text.bytes().enumerate() {
        if c.is_ascii_whitespace() {
            continue;
        }
        if c == b'=' {
            padding += 1;
            continue;
        }
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => {
                return Err(format!(
                    "base64: byte {i} ({c:#04x}) is outside the alphabet"
                ))
            }
        };
        if padding > 0 {
            return Err(format!("base64: data after the padding at byte {i}"));
        }
        acc = (acc << 6) | u32::from(v);
        n += 1;
        if n.is_multiple_of(4) {
            out.extend_from_slice(&[(acc >> 16) as u8, (acc >> 8) as u8, acc as u8]);
            acc = 0;
        }
    }
    match n % 4 {
        0 => {}
        2 => out.push((acc >> 4) as u8),
        3 => out.extend_from_slice(&[(acc >> 10) as u8, (acc >> 2) as u8]),
        _ => return Err("base64: the text ends with one character of a group".into()),
    }
    if padding > 2 || (padding > 0 && (n + padding) % 4 != 0) {
        return Err("base64: wrong padding".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rfc_vectors() {
        for (plain, coded) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(encode_base64(plain.as_bytes()), coded);
            assert_eq!(decode_base64(coded).unwrap(), plain.as_bytes());
            assert_eq!(
                decode_base64(coded.trim_end_matches('=')).unwrap(),
                plain.as_bytes()
            );
        }
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(decode_base64(&encode_base64(&all)).unwrap(), all);
        assert_eq!(decode_base64("Zm9v\r\nYmFy").unwrap(), b"foobar");
    }

    #[test]
    fn bad_text_is_refused() {
        assert!(decode_base64("Zm9v!").unwrap_err().contains("alphabet"));
        assert!(decode_base64("Zg==Zg==").unwrap_err().contains("padding"));
        assert!(decode_base64("Z").is_err());
        assert!(decode_base64("Zm9v=").is_err());
    }
}
