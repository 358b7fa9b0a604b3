//! Reading lines with a bound, so a peer that sends a gigabyte without a newline costs no memory.

use std::io::{self, BufRead};

/// What [`read_line_bounded`] read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineRead {
    /// A line is in the buffer (without its `\n` or `\r\n`). The last line of a stream may lack the
    /// newline.
    Line,
    /// The line was longer than the bound; it was read and thrown away up to its newline, and the buffer
    /// is empty.
    TooLong,
    /// The stream ended with nothing more to read.
    Eof,
}

/// Reads the next line into `buf` (cleared first), keeping at most `max` bytes of it.
pub fn read_line_bounded(
    reader: &mut impl BufRead,
    buf: &mut Vec<u8>,
    max: usize,
) -> io::Result<LineRead> {
    buf.clear();
    let mut too_long = false;
    let mut read_any = false;
    loop {
        let chunk = match reader.fill_buf() {
            Ok(c) => c,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if chunk.is_empty() {
            break;
        }
        read_any = true;
        let (part, used, ended) = match chunk.iter().position(|&b| b == b'\n') {
            Some(i) => (&chunk[..i], i + 1, true),
            None => (chunk, chunk.len(), false),
        };
        if !too_long {
            if buf.len() + part.len() > max {
                too_long = true;
                buf.clear();
                buf.shrink_to(64 << 10);
            } else {
                buf.extend_from_slice(part);
            }
        }
        reader.consume(used);
        if ended {
            break;
        }
    }
    if too_long {
        return Ok(LineRead::TooLong);
    }
    if !read_any {
        return Ok(LineRead::Eof);
    }
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    Ok(LineRead::Line)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufReader, Cursor};

    #[test]
    fn lines_long_lines_and_the_end() {
        let text = format!("GEN {{}}\r\n{}\nQUIT {{}}\nlast", "x".repeat(100));
        // A tiny internal buffer makes lines span many fill_buf calls.
        let mut r = BufReader::with_capacity(7, Cursor::new(text.into_bytes()));
        let mut buf = Vec::new();
        assert_eq!(
            read_line_bounded(&mut r, &mut buf, 50).unwrap(),
            LineRead::Line
        );
        assert_eq!(buf, b"GEN {}");
        assert_eq!(
            read_line_bounded(&mut r, &mut buf, 50).unwrap(),
            LineRead::TooLong
        );
        assert!(buf.is_empty());
        assert_eq!(
            read_line_bounded(&mut r, &mut buf, 50).unwrap(),
            LineRead::Line
        );
        assert_eq!(buf, b"QUIT {}");
        assert_eq!(
            read_line_bounded(&mut r, &mut buf, 50).unwrap(),
            LineRead::Line
        );
        assert_eq!(buf, b"last");
        assert_eq!(
            read_line_bounded(&mut r, &mut buf, 50).unwrap(),
            LineRead::Eof
        );
    }

    #[test]
    fn an_empty_line_is_a_line() {
        let mut r = Cursor::new(b"\n\n".to_vec());
        let mut buf = Vec::new();
        assert_eq!(
            read_line_bounded(&mut r, &mut buf, 5).unwrap(),
            LineRead::Line
        );
        assert!(buf.is_empty());
        assert_eq!(
            read_line_bounded(&mut r, &mut buf, 5).unwrap(),
            LineRead::Line
        );
        assert_eq!(
            read_line_bounded(&mut r, &mut buf, 5).unwrap(),
            LineRead::Eof
        );
    }
}
