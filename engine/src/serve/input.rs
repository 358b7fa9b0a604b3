//! The stdin reader: a thread that reads request lines (at most [`MAX_LINE_BYTES`] each, longer ones
//! reported without being kept), parses them, and passes them on through a channel. The serve loop
//! waits on the channel when idle and looks at it between tokens while a request runs.

use std::io::{BufReader, Read};
use std::sync::mpsc::{sync_channel, Receiver};
use std::thread;

use poly_protocol::{
    read_line_bounded, ErrorCode, LineRead, ProtocolError, ToEngine, MAX_LINE_BYTES,
};

/// What the reader saw.
#[derive(Debug)]
pub enum Input {
    /// A well-formed request.
    Message(ToEngine),
    /// A line that is not one: the error to answer.
    Bad(ProtocolError),
    /// A line longer than [`MAX_LINE_BYTES`] (skipped).
    TooLong,
    /// End of input: treated as QUIT.
    Closed,
    /// Reading failed.
    Failed(std::io::Error),
}

/// Lines parsed ahead of the serve loop: enough to keep a burst of requests flowing, few enough that a
/// flood waits in the pipe instead of in memory.
const CHANNEL_DEPTH: usize = 64;

/// Starts the reader thread on `source`.
pub fn spawn_reader(source: impl Read + Send + 'static) -> Receiver<Input> {
    let (tx, rx) = sync_channel(CHANNEL_DEPTH);
    let reader = move || {
        let mut source = BufReader::new(source);
        let mut line = Vec::new();
        loop {
            let input = match read_line_bounded(&mut source, &mut line, MAX_LINE_BYTES) {
                Ok(LineRead::Line) => match std::str::from_utf8(&line) {
                    Ok(text) => match ToEngine::parse(text) {
                        Ok(msg) => Input::Message(msg),
                        Err(e) => Input::Bad(e),
                    },
                    Err(_) => Input::Bad(ProtocolError::new(
                        None,
                        ErrorCode::BadRequest,
                        "the line is not UTF-8",
                    )),
                },
                Ok(LineRead::TooLong) => Input::TooLong,
                Ok(LineRead::Eof) => Input::Closed,
                Err(e) => Input::Failed(e),
            };
            let last = matches!(input, Input::Closed | Input::Failed(_));
            // The serve loop has stopped listening: nothing left to read for.
            if tx.send(input).is_err() || last {
                return;
            }
        }
    };
    // A reader that cannot start reads as a closed input (the loop then quits).
    if let Err(e) = thread::Builder::new().name("stdin".into()).spawn(reader) {
        eprintln!("poly-engine: cannot start the stdin reader: {e}");
    }
    rx
}
