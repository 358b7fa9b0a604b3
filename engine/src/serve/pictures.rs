//! A GEN's pictures (`--mmproj`): decoded and encoded by the projector when the request arrives, so that
//! a bad picture is one `ERR bad_request` before anything runs, and the prompt widened: each picture's
//! placeholder token becomes as many tokens of the same id as the picture has rows, which the prompt's
//! read replaces by the rows ([`crate::Model::eval_picture`]).
//!
//! The conversation cache tells pictures apart by a keyed hash of their file bytes ([`picture_key`]),
//! recorded in the state beside the placeholder tokens ([`crate::state::SeqState::key_last_picture`]): a
//! kept state is reused only up to the first picture that differs, since the placeholders alone are the
//! same for every picture of the same size.

use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, OnceLock};

use poly_models::vision::{ImageRows, VisionEncoder};
use poly_protocol::{ErrorCode, Picture};

/// One picture of a checked request, in the widened prompt's positions.
#[derive(Clone, Debug, PartialEq)]
pub struct JobPicture {
    /// Its first row's position in the widened prompt.
    pub start: usize,
    /// The position after its last row.
    pub end: usize,
    /// [`picture_key`] of its file bytes.
    pub key: u64,
    pub rows: Arc<ImageRows>,
}

/// The process's hash of a picture's bytes: SipHash under keys drawn once per process, so that two
/// pictures collide with chance 2⁻⁶⁴ and nobody can make them collide on purpose without the keys (the
/// kept states live no longer than the process).
pub fn picture_key(bytes: &[u8]) -> u64 {
    static KEYS: OnceLock<std::collections::hash_map::RandomState> = OnceLock::new();
    let mut h = KEYS.get_or_init(Default::default).build_hasher();
    h.write(bytes);
    h.finish()
}

/// The pictures encoded last, by [`picture_key`]: a chat sends its whole conversation every turn, so
/// the same picture comes again with each question about it, and encoding it again would cost each turn
/// the encoder's time (seconds for a real projector on the CPU). Bounded in rows' bytes and entries,
/// the least recently used dropped first.
#[derive(Debug, Default)]
pub struct PictureCache {
    /// Least recently used first.
    entries: Vec<(u64, Arc<ImageRows>)>,
    /// Pictures encoded, and pictures whose rows were found here (STATS).
    pub encoded: u64,
    pub reused: u64,
}

/// The most rows' bytes [`PictureCache`] keeps (a few large pictures' rows on a real model).
pub const PICTURE_CACHE_BYTES: usize = 256 << 20;
/// The most pictures it keeps.
pub const PICTURE_CACHE_ENTRIES: usize = 16;

impl PictureCache {
    /// The rows of the picture whose file bytes are `bytes` (key `key`), encoded by `encode` unless kept.
    fn rows(
        &mut self,
        key: u64,
        encode: impl FnOnce() -> Result<ImageRows, String>,
    ) -> Result<Arc<ImageRows>, String> {
        if let Some(i) = self.entries.iter().position(|(k, _)| *k == key) {
            let entry = self.entries.remove(i);
            let rows = entry.1.clone();
            self.entries.push(entry);
            self.reused += 1;
            return Ok(rows);
        }
        let rows = Arc::new(encode()?);
        self.encoded += 1;
        self.entries.push((key, rows.clone()));
        let bytes = |e: &[(u64, Arc<ImageRows>)]| -> usize {
            e.iter().map(|(_, r)| r.values.len() * 4).sum()
        };
        while self.entries.len() > PICTURE_CACHE_ENTRIES
            || (self.entries.len() > 1 && bytes(&self.entries) > PICTURE_CACHE_BYTES)
        {
            self.entries.remove(0);
        }
        Ok(rows)
    }
}

/// A request's prompt with its pictures read: the widened tokens and the pictures in them.
#[derive(Debug)]
pub struct Widened {
    pub tokens: Vec<u32>,
    pub pictures: Vec<JobPicture>,
}

impl Widened {
    /// Where position `p` of the request's own tokens lands in the widened prompt: past the rows the
    /// pictures whose placeholders stood before `p` added.
    pub fn position(&self, p: usize) -> usize {
        let mut added = 0;
        for q in &self.pictures {
            // Picture q's placeholder stood at q.start less the rows the pictures before it added.
            if q.start - added >= p {
                break;
            }
            added += q.end - q.start - 1;
        }
        p + added
    }
}

/// Decodes and encodes `pictures` (base64 image files, checked in order by the protocol) with `vision`
/// and widens `tokens` at each picture's `at`. The message says which picture failed and why. A prompt
/// that outgrows `n_ctx` stops the reading there (`context_overflow`), so a request holds at most a
/// context's worth of rows however many pictures it names.
pub fn widen(
    tokens: &[u32],
    pictures: &[Picture],
    vision: Option<&VisionEncoder>,
    n_ctx: usize,
    cache: &mut PictureCache,
) -> Result<Widened, (ErrorCode, String)> {
    let bad = |m: String| (ErrorCode::BadRequest, m);
    if pictures.is_empty() {
        return Ok(Widened {
            tokens: tokens.to_vec(),
            pictures: Vec::new(),
        });
    }
    let Some(vision) = vision else {
        return Err(bad(
            "the request has pictures, but this engine has no projector to read them (start it with \
             --mmproj FILE)"
                .into(),
        ));
    };
    let mut out = Vec::with_capacity(tokens.len());
    let mut read = Vec::with_capacity(pictures.len());
    let mut from = 0;
    for (i, p) in pictures.iter().enumerate() {
        let at = p.at as usize;
        // The protocol checked the order and that a token follows each picture.
        let Some(&placeholder) = tokens.get(at) else {
            return Err(bad(format!("pictures[{i}].at {at} is outside the prompt")));
        };
        let bytes = poly_protocol::decode_base64(&p.data)
            .map_err(|e| bad(format!("pictures[{i}].data: {e}")))?;
        let key = picture_key(&bytes);
        let rows = cache
            .rows(key, || {
                vision.encode_picture(&bytes).map_err(|e| e.to_string())
            })
            .map_err(|e| bad(format!("pictures[{i}]: {e}")))?;
        if rows.n_rows() == 0 {
            return Err(bad(format!("pictures[{i}]: the projector wrote no rows")));
        }
        // The rows so far, the tokens left and the placeholders of the pictures left.
        let widened = out.len() + (at - from) + rows.n_rows() + (tokens.len() - at - 1);
        if widened > n_ctx {
            return Err((
                ErrorCode::ContextOverflow,
                format!(
                    "with pictures[..={i}] read, the prompt is {widened} tokens, over the context of \
                     {n_ctx}"
                ),
            ));
        }
        out.extend_from_slice(&tokens[from..at]);
        let start = out.len();
        out.extend(std::iter::repeat_n(placeholder, rows.n_rows()));
        read.push(JobPicture {
            start,
            end: out.len(),
            key,
            rows,
        });
        from = at + 1;
    }
    out.extend_from_slice(&tokens[from..]);
    Ok(Widened {
        tokens: out,
        pictures: read,
    })
}

/// The forward call's end when a prompt is read from `pos` and would end at `next`: a picture is read
/// whole in a call of its own rows and the text before it in the same call, never split (its rows see
/// each other only within one call's positions), so a call stops before a picture it cannot finish...
/// and one that starts at a picture takes all of it even past `next`.
pub fn call_end(pictures: &[JobPicture], pos: usize, next: usize) -> usize {
    let Some(i) = pictures.iter().position(|q| q.end > pos) else {
        return next;
    };
    let q = &pictures[i];
    if q.start > pos {
        // Text first, up to the picture; the picture then starts a call.
        return next.min(q.start);
    }
    // The call starts with the picture (never inside it: reads resume only at a picture's edges).
    let next = next.max(q.end);
    match pictures.get(i + 1) {
        Some(after) => next.min(after.start),
        None => next,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn picture(start: usize, end: usize) -> JobPicture {
        JobPicture {
            start,
            end,
            key: 0,
            rows: Arc::new(ImageRows {
                n_x: end - start,
                n_y: 1,
                width: 1,
                values: vec![0.0; end - start],
            }),
        }
    }

    #[test]
    fn calls_read_a_picture_whole_and_alone_among_pictures() {
        let pics = [picture(4, 10), picture(12, 20)];
        assert_eq!(call_end(&pics, 0, 3), 3);
        assert_eq!(call_end(&pics, 0, 8), 4);
        assert_eq!(call_end(&pics, 4, 6), 10);
        assert_eq!(call_end(&pics, 4, 30), 12);
        assert_eq!(call_end(&pics, 10, 30), 12);
        assert_eq!(call_end(&pics, 12, 13), 20);
        assert_eq!(call_end(&pics, 20, 30), 30);
    }

    #[test]
    fn the_cache_keeps_the_latest_pictures_within_its_bounds() {
        let mut cache = PictureCache::default();
        let rows = |n: usize| ImageRows {
            n_x: n,
            n_y: 1,
            width: 1,
            values: vec![n as f32; n],
        };
        for k in 0..PICTURE_CACHE_ENTRIES as u64 + 1 {
            cache.rows(k, || Ok(rows(1))).unwrap();
        }
        assert_eq!(cache.encoded, PICTURE_CACHE_ENTRIES as u64 + 1);
        // Picture 0 went first; 1 is still kept (and now the most recent).
        assert_eq!(cache.rows(1, || Err("kept".into())).unwrap().n_x, 1);
        assert_eq!(cache.reused, 1);
        assert!(cache.rows(0, || Err("encoded again".into())).is_err());
        // A failed encoding keeps nothing; rows over the byte bound push the others out.
        assert_eq!(cache.entries.len(), PICTURE_CACHE_ENTRIES);
        let big = PICTURE_CACHE_BYTES / 4;
        cache.rows(99, || Ok(rows(big))).unwrap();
        assert_eq!(cache.entries.len(), 1);
    }

    #[test]
    fn request_positions_map_past_the_widened_pictures() {
        // Request [a, P, b, c, Q, d]: P of 3 rows at 1, Q of 2 rows at 4.
        let w = Widened {
            tokens: Vec::new(),
            pictures: vec![picture(1, 4), picture(6, 8)],
        };
        let mapped: Vec<usize> = (0..=6).map(|p| w.position(p)).collect();
        assert_eq!(mapped, vec![0, 1, 4, 5, 6, 8, 9]);
    }
}
