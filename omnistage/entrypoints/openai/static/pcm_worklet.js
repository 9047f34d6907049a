// The microphone's AudioWorklet: hands each block of samples (Float32, the context's rate) to
// the page, which resamples it to 16 kHz PCM16 for input_audio_buffer.append.
class PcmCapture extends AudioWorkletProcessor {
  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (channel) this.port.postMessage(channel.slice(0));
    return true;
  }
}
registerProcessor("pcm-capture", PcmCapture);
